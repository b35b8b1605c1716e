"""A fake OpenAI-compatible streaming server for the benchmark client's tests.

Stdlib only (``http.server``), HTTP/1.1 with chunked bodies so a test can cut a
stream mid-body. What a request gets depends on its prompt (completions) or last
message (chat) containing one of these words:

- (none): three text chunks ``delay`` apart, the last with ``finish_reason``, a
  usage chunk (prompt_tokens = words in the prompt, completion_tokens = 3), [DONE];
- ``nousage``: the same without the usage chunk;
- ``multitoken``: two text chunks, usage says 5 tokens;
- ``error500`` / ``bad400``: a JSON error response with that status;
- ``disconnect``: one chunk, then the connection closes mid-body;
- ``streamerror``: one chunk, then ``data: {"error": ...}``;
- ``truncated``: two chunks, then a clean end with no finish_reason or [DONE];
- ``hang``: sets ``state.hanging`` and answers nothing until the server stops.

Chat streams start with a role-only chunk. ``/metrics`` serves counters that grow
with every streamed request (or 404 when ``metrics=False``). Run as a script
(``--port P``) it serves until killed, for the sweep test.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL_ID = "fake-model"


class FakeState:
    """What the server saw; shared with the test thread (guarded by ``lock``)."""

    def __init__(self, delay: float, metrics: bool) -> None:
        self.delay, self.metrics = delay, metrics
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []  # payload + start/end times
        self.in_flight = 0
        self.max_in_flight = 0
        self.streamed = 0
        # Set by a test to make the first ``parties`` requests wait for each other: the
        # overlap it checks is then a fact, not a matter of timing.
        self.rendezvous: threading.Barrier | None = None
        self.rendezvous_left = 0
        self.hanging = threading.Event()  # a ``hang`` request has arrived
        self.stopped = threading.Event()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    # ---------------------------------------------------------- plumbing
    def _send_json(self, status: int, body: Any, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _event(self, payload: Any) -> None:
        self._chunk("data: " + (payload if isinstance(payload, str) else json.dumps(payload)) + "\n\n")

    # ---------------------------------------------------------- routes
    def do_GET(self) -> None:
        state = self.server.state
        if self.path == "/health":
            self._send_json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})
        elif self.path == "/metrics" and state.metrics:
            with state.lock:
                n = state.streamed
            text = ("# HELP kvloom:prefix_cache_hits Prompt tokens served from the prefix cache.\n"
                    "# TYPE kvloom:prefix_cache_hits counter\n"
                    f"kvloom:prefix_cache_hits_total {10.0 * n}\n"
                    f"kvloom:prefix_cache_hits_created 1700000000.0\n"
                    f"kvloom:prefix_cache_queries_total {40.0 * n}\n"
                    f"kvloom:num_preemptions_total {float(n // 2)}\n"
                    f'vllm:prefix_cache_hits_total{{model_name="a b}}c"}} {5.0 + n}\n'
                    "kvloom:num_requests_running 3\n"
                    "process_cpu_seconds_total 12.5\n")
            self._send_json(200, text, "text/plain; version=0.0.4")
        else:
            self._send_json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        state = self.server.state
        length = int(self.headers.get("Content-Length", "0"))
        payload = json.loads(self.rfile.read(length))
        record = {"path": self.path, "payload": payload, "start": time.perf_counter()}
        with state.lock:
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            # Recorded on arrival: the client may read the last chunk before this thread
            # gets back from _respond, and tests look at the record right after.
            state.requests.append(record)
            meet = state.rendezvous if state.rendezvous_left > 0 else None
            state.rendezvous_left -= meet is not None
        if meet is not None:
            meet.wait(timeout=30)
        self._record = record
        self._left = False
        try:
            self._respond(payload)
        finally:
            record.setdefault("end", time.perf_counter())
            self._leave()

    def _leave(self) -> None:
        """The request no longer counts as in flight (once; before a stream's end reaches
        the client, which may send its next request as soon as it sees it)."""
        if not self._left:
            self._left = True
            with self.server.state.lock:
                self.server.state.in_flight -= 1

    def _respond(self, payload: dict[str, Any]) -> None:
        state = self.server.state
        chat = self.path == "/v1/chat/completions"
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._send_json(404, {"error": {"message": "no such route"}})
            return
        prompt = payload["messages"][-1]["content"] if chat else payload["prompt"]
        if "hang" in prompt:
            state.hanging.set()
            state.stopped.wait(timeout=60)
            return
        if "error500" in prompt:
            self._send_json(500, {"error": {"message": "boom", "type": "InternalServerError"}})
            return
        if "bad400" in prompt:
            self._send_json(400, {"error": {"message": "bad request", "type": "BadRequestError"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with state.lock:
            state.streamed += 1

        def choice(text: str, finish: str | None = None) -> dict[str, Any]:
            if chat:
                return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        if chat:
            self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}]})
        texts = ["a", "b"] if ("multitoken" in prompt or "truncated" in prompt) else ["a", "b", "c"]
        for index, text in enumerate(texts):
            time.sleep(state.delay)
            last = index == len(texts) - 1 and "truncated" not in prompt
            self._event({"choices": [choice(text, "length" if last else None)], "usage": None})
            if "disconnect" in prompt:
                self.wfile.write(b"40\r\ndata: {\"choi")  # half a chunk, then the socket closes
                self.wfile.flush()
                self.close_connection = True
                return
            if "streamerror" in prompt:
                self._event({"error": {"message": "oops", "code": 500}})
                self._chunk("")
                return
        if "truncated" in prompt:
            self._chunk("")
            return
        if "nousage" not in prompt:
            completion = 5 if "multitoken" in prompt else 3
            self._event({"choices": [], "usage": {"prompt_tokens": len(prompt.split()),
                                                  "completion_tokens": completion,
                                                  "total_tokens": len(prompt.split()) + completion}})
        self._record["end"] = time.perf_counter()  # before the client can see the end
        self._leave()
        self._event("[DONE]")
        self._chunk("")


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0, delay: float = 0.02, metrics: bool = True) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.state = FakeState(delay, metrics)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start_in_thread(self) -> FakeServer:
        # A short poll interval: shutdown() waits up to one of them.
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def stop(self) -> None:
        self.state.stopped.set()
        self.shutdown()
        self.server_close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gives up mid-stream (some tests make it) breaks the pipe: expected.
        # Anything else is a bug in the fake and is reported as usual.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.005)
    cli = parser.parse_args()
    FakeServer(cli.port, cli.delay).serve_forever()
