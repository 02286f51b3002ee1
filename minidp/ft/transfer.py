"""Healing over the network: a replica serves its state from memory; a joiner fetches it from a peer.

A source serializes its state once after the round it heals from (torch.save into bytes in memory,
never to disk) and serves it over HTTP from a thread while its training goes on. The joiner reads it
in one GET; a response cut short (the source died mid-transfer) raises, and the joiner takes the
state from its next source. A state whose model differs from the joiner's is refused, naming the
first difference.
"""
from __future__ import annotations

import http.client
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

KEEP = 2  # snapshots kept: a slow joiner may still be reading the one before the newest
CHUNK_BYTES = 1 << 20


def signature(state_dict: dict) -> list:
    """[name, shape, dtype] of every entry of a model's state_dict: what two replicas must agree on."""
    return [[k, list(v.shape), str(v.dtype)] if torch.is_tensor(v) else [k, None, type(v).__name__]
            for k, v in state_dict.items()]


def first_mismatch(mine: list, theirs: list) -> str | None:
    """The first entry where two signatures differ, in words; None when they are equal."""
    theirs_by_name = {e[0]: e for e in theirs}
    for name, shape, dtype in mine:
        other = theirs_by_name.get(name)
        if other is None:
            return f"'{name}' is in this replica's model but not in the run's"
        if other[1] != shape:
            return f"'{name}' has shape {tuple(shape)} here but {tuple(other[1])} in the run's model"
        if other[2] != dtype:
            return f"'{name}' has dtype {dtype} here but {other[2]} in the run's model"
    extra = [e[0] for e in theirs if e[0] not in {m[0] for m in mine}]
    return f"'{extra[0]}' is in the run's model but not in this replica's" if extra else None


class StateServer:
    """Serves this replica's snapshots, `GET /state/<round>`, from a daemon thread.

    Args:
        host: the address peers reach this replica at. Default "127.0.0.1".
    """

    def __init__(self, host: str = "127.0.0.1"):
        self.snapshots: dict[int, bytes] = {}
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                blob = server.snapshot(self.path)
                if blob is None:
                    self.send_error(404, "no such snapshot")
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(blob)))
                self.end_headers()
                for start in range(0, len(blob), CHUNK_BYTES):
                    server.send_chunk(self.wfile, blob[start:start + CHUNK_BYTES])

            def log_message(self, *args):  # quiet: one line a request is noise in a training log
                pass

        self.http = ThreadingHTTPServer((host, 0), Handler)
        self.http.daemon_threads = True
        self.address = f"{host}:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                         name="minidp-ft-state").start()

    def publish(self, round_id: int, state: dict) -> None:
        """Serialize `state` (tensors on the CPU) as the snapshot after round `round_id`."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        with self.lock:
            self.snapshots[round_id] = buffer.getvalue()
            for old in sorted(self.snapshots)[:-KEEP]:
                del self.snapshots[old]

    def snapshot(self, path: str) -> bytes | None:
        try:
            round_id = int(path.rsplit("/", 1)[-1])
        except ValueError:
            return None
        with self.lock:
            return self.snapshots.get(round_id)

    def send_chunk(self, wfile, chunk: bytes) -> None:
        """Write one piece of a response (a separate method: a test kills a source between pieces)."""
        wfile.write(chunk)

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def fetch_state(address: str, round_id: int, timeout: float) -> dict:
    """The snapshot after round `round_id` from the replica serving at `address` ("host:port").

    Raises:
        OSError, http.client.HTTPException: the source is gone, or died mid-transfer.
    """
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", f"/state/{round_id}")
        response = conn.getresponse()
        if response.status != 200:
            raise http.client.HTTPException(f"{address} has no snapshot of round {round_id} "
                                            f"(HTTP {response.status})")
        blob = response.read()  # IncompleteRead if the source died before the last byte
    finally:
        conn.close()
    return torch.load(io.BytesIO(blob), weights_only=False)
