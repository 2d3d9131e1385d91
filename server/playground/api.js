// The page's only way to the server: the public API, with the key the user typed as a bearer token.
// URLs are relative so the page also works behind a proxy that serves it under a path prefix.

export class APIError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function authHeaders(key) {
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = body?.error?.message || message;
  } catch {
    // Not the API's JSON error shape: the status line says enough.
  }
  if (response.status === 401) message += " Enter the server's API key above.";
  return new APIError(response.status, message);
}

export async function getJSON(path, key) {
  const response = await fetch(path, { headers: authHeaders(key) });
  if (!response.ok) throw await failure(response);
  return response.json();
}

export async function getText(path, key) {
  const response = await fetch(path, { headers: authHeaders(key) });
  if (!response.ok) throw await failure(response);
  return response.text();
}

// POSTs ``body`` and yields each server-sent event's parsed JSON until [DONE]. fetch and a stream
// reader, not EventSource, because EventSource can neither POST nor send an Authorization header.
export async function* streamEvents(path, body, key, signal) {
  const response = await fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...authHeaders(key) },
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    const events = buffer.split(/\r?\n\r?\n/);
    buffer = events.pop();
    for (const event of events) {
      const data = event
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const parsed = JSON.parse(data);
      if (parsed.error) throw new APIError(0, parsed.error.message || "the server reported an error");
      yield parsed;
    }
  }
}
