"""Parts of scripts/device_check.py (the one-run GPU check)."""
