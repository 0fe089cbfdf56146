"""Generation stall during weight updates, as a streaming client of the vLLM server sees it.

`TokenStream` keeps one streaming greedy completion running against the server for as long as
it is open (a new one starts when one ends) and records when each token arrived. `stall_s` turns
those times into the stall of one update window: the longest gap between two consecutive tokens
of one request that overlaps the window, minus the median gap outside every update window (the
server's normal pace, so a route that never stops generation scores about 0; one that stops it
for the whole update scores about the update's length).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Sequence

__all__ = ["TokenStream", "stall_s"]

Gap = tuple[float, float]  # (previous token's arrival, this token's arrival), perf_counter seconds


class TokenStream:
    """A background streaming client of ``url`` (an OpenAI-compatible vLLM server, token-id
    prompts); `gaps` holds every inter-token gap seen so far."""

    def __init__(self, url: str, prompt: Sequence[int] = (5, 17, 42, 9), max_tokens: int = 96,
                 timeout: float = 600.0) -> None:
        import requests

        self.url, self.prompt, self.max_tokens, self.timeout = url, list(prompt), max_tokens, timeout
        self.model = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        self.gaps: list[Gap] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="awex-token-stream")

    def __enter__(self) -> TokenStream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._one_request()
        except BaseException as exc:  # noqa: BLE001 - read by the caller through `error`
            self.error = exc

    def _one_request(self) -> None:
        import requests

        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        # the first gap runs from sending the request to its first token: a request that waits
        # behind a stopped engine shows the whole wait (a client sees exactly that)
        last = time.perf_counter()
        with requests.post(self.url + "/v1/completions", json=body, stream=True, timeout=self.timeout) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                json.loads(line[6:])  # a malformed event is an error, not a token
                now = time.perf_counter()
                self.gaps.append((last, now))
                last = now
                if self._stop.is_set():
                    return


def stall_s(gaps: Sequence[Gap], window: Gap, windows: Sequence[Gap]) -> float | None:
    """The stall of update ``window`` (module docstring); ``windows``: every update window (the
    gaps outside all of them set the normal pace). None when no gap overlaps the window or no
    gap lies outside every window."""
    def overlaps(gap: Gap, w: Gap) -> bool:
        return gap[0] < w[1] and gap[1] > w[0]

    during = [b - a for a, b in gaps if overlaps((a, b), window)]
    normal = [b - a for a, b in gaps if not any(overlaps((a, b), w) for w in windows)]
    if not during or not normal:
        return None
    return max(0.0, max(during) - statistics.median(normal))
