"""`tensorboard` in a subprocess on 127.0.0.1, for tests that go through HTTP."""

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60


class TensorBoard:
    """`tensorboard --logdir LOGDIR --host 127.0.0.1 --port 0` in a subprocess."""

    def __init__(self, logdir, *flags):
        plugins = importlib.metadata.entry_points(group="tensorboard_plugins")
        if "accumulation" not in {entry_point.name for entry_point in plugins}:
            pytest.fail("TensorBoard would not load the dashboard: the `accumulation` "
                        "tensorboard_plugins entry point is not installed. Reinstall the "
                        "package (`make test`, or `pip install -e .`).")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
             "--host", "127.0.0.1", "--port", "0", *flags],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, start_new_session=True,  # its own group: stop() ends its helpers too
        )
        self.stderr = []
        self.url = None
        self._started = threading.Event()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stderr(self):
        for line in self.process.stderr:  # read to the end so the pipe never fills
            self.stderr.append(line)
            found = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
            if found and self.url is None:
                self.url = found.group(1)
                self._started.set()
        self._started.set()

    def wait_started(self):
        self._started.wait(TIMEOUT_S)
        if self.url is None:
            pytest.fail("TensorBoard did not start:\n" + "".join(self.stderr[-30:]))

    def get_json(self, path):
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.load(response)

    def wait_for(self, predicate, what):
        """Polls `predicate(self)` until it holds: TensorBoard loads logs in the background."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail("TensorBoard exited:\n" + "".join(self.stderr[-30:]))
            try:
                if predicate(self):
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.2)
        pytest.fail(f"TensorBoard never served {what}:\n" + "".join(self.stderr[-30:]))

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
