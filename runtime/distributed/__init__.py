"""Tensor parallelism over ``torch.distributed``: servelm's Llama-family model split Megatron-style
across N ranks (``sharding``), one step's inputs broadcast from rank 0 (``step_message``), the runner
every rank runs (``tp_runner``), and the processes that hold the ranks (``launcher``).

Rank 0 is the process that runs the scheduler and samples; ranks 1..N-1 only run forwards.
"""
