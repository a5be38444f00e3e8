"""A live server on 127.0.0.1 (a free port), run by uvicorn in a thread of the test process."""

import socket
import threading
import time

import pytest
import uvicorn

from kk_jax.server.cli import build, parser

SERVER_FLAGS = ["--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                "--decode-steps", "4", "--served-model-name", "tiny", "--log-level", "warning"]


class LiveServer:
    def __init__(self, argv):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app, self.engine = build(parser().parse_args(argv + ["--port", str(self.port)]))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.shutdown()


@pytest.fixture(scope="session")
def live(tiny_ckpt, tmp_path_factory):
    srv = LiveServer(["--model", str(tiny_ckpt), "--profile-dir", str(tmp_path_factory.mktemp("prof")),
                      "--max-request-body-bytes", "65536"] + SERVER_FLAGS)
    yield srv
    srv.stop()


def wait_pages_free(engine, timeout=10.0) -> bool:
    """True once every page is back in the free list (aborts land on the engine thread)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = engine.call(lambda e: e.stats())
        if st["pages_free"] == st["pages_total"] and st["running"] == 0 and st["waiting"] == 0:
            return True
        time.sleep(0.05)
    return False
