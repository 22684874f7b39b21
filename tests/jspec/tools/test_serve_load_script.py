"""scripts/serve_load.py's client: a round's requests all at once, or at most --max-concurrency in flight (the next
sent as one ends), against a stand-in completions server that counts the requests it holds at once."""

import http.server
import importlib.util
import json
import os
import threading
import time

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts", "serve_load.py")


def _serve_load():
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Counting(http.server.BaseHTTPRequestHandler):
    lock = threading.Lock()
    held = most = 0

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.held += 1
            cls.most = max(cls.most, cls.held)
        time.sleep(0.2)  # long enough for the requests the client has in flight to arrive
        with cls.lock:
            cls.held -= 1
        reply = json.dumps({"usage": {"completion_tokens": body["max_tokens"]}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


@pytest.mark.parametrize("max_concurrency", [None, 3])
def test_fire_holds_at_most_max_concurrency_requests_in_flight(max_concurrency):
    serve_load = _serve_load()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Counting.held = _Counting.most = 0
    try:
        requests = [{"prompt": "x", "max_tokens": n} for n in range(1, 13)]
        lengths: list[int] = []
        seconds, latencies, tokens = serve_load.fire(f"http://127.0.0.1:{server.server_address[1]}", "m", requests,
                                                     lengths, max_concurrency=max_concurrency)
    finally:
        server.shutdown()
    if max_concurrency is None:  # all at once (12 threads; how many arrive together depends on the machine)
        assert _Counting.most > 3
    else:
        assert _Counting.most == max_concurrency
        assert seconds >= 0.2 * 12 / max_concurrency  # four waves of three
    assert lengths == list(range(1, 13)) and tokens == 78 and len(latencies) == 12
