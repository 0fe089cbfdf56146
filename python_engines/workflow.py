"""Asynchronous rollout: `WorkflowExecutor` (bounded queues, staleness control) and `RLVRWorkflow`.

Why staleness control: in asynchronous RL the inference engine keeps generating while the
trainer trains, so a trajectory may be produced by weights several versions older than the
policy it trains. AReaL bounds this: with consumer batch size ``bs``, at most
``max_head_offpolicyness`` (``k``) versions of lag are allowed, so by weight version ``v`` no
more than ``(k + v + 1) * bs`` trajectories may have been *started* in total. The executor
starts an episode only while

    capacity = min(max_concurrent_rollouts - running,
                   (k + version + 1) * bs - (accepted + running)) > 0

where ``accepted`` counts finished, accepted trajectories since the start (it is never reset:
it is the sample count the version bound is about), ``running`` those in flight, and
``version`` is ``engine.get_version()``. When several clients (ranks of a distributed trainer)
each run an executor, each takes its share: ``max_concurrent_rollouts // num_clients`` and
``consumer_batch_size // num_clients`` (at least 1), as AReaL divides by the world size.

Contract: ``submit`` queues data (a bounded input queue: `RuntimeError` when full); a private
event-loop thread starts ``workflow.arun_episode(engine, data)`` tasks as capacity allows, and
puts finished trajectories (TensorDicts) into a bounded output buffer; ``wait(count, timeout,
should_accept)`` returns ``count`` of them concatenated (padded on dim 1), raising
`TimeoutError` when fewer arrive in time (those that did stay buffered); a trajectory that
``should_accept`` rejects, or an episode that returns None, frees its budget (``accepted`` is
decremented). ``pause`` stops new episodes from starting (those running finish); ``resume``
lifts it. An episode that raises is reported by the next ``wait``.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from awex_fast.net import EventLoopThread
from python_engines.api import GenerationHyperparameters, InferenceEngine, LLMRequest, RolloutWorkflow

if TYPE_CHECKING:
    from python_engines.api import InferenceEngineConfig

__all__ = ["RLVRWorkflow", "RolloutStat", "WorkflowExecutor", "concat_padded"]

logger = logging.getLogger(__name__)

_TICK_S = 0.01


def concat_padded(items: list[TensorDict], pad_value: float = 0) -> TensorDict:
    """Concatenate TensorDicts on dim 0, right-padding every entry with >= 2 dims on dim 1 to
    the longest (``attention_mask`` and ``loss_mask`` pad with 0 like the rest)."""
    if not items:
        raise ValueError("concat_padded: no TensorDicts to concatenate")
    keys = list(items[0].keys())
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        parts = [td[key] for td in items]
        if parts[0].dim() >= 2:
            width = max(p.shape[1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, width - p.shape[1]),
                                             value=pad_value) for p in parts]
        out[key] = torch.cat(parts, dim=0)
    return TensorDict(out, batch_size=[sum(td.batch_size[0] for td in items)])


@dataclass
class RolloutStat:
    """Counters behind the staleness bound (see the module docstring)."""

    submitted: int = 0
    accepted: int = 0
    running: int = 0
    rejected: int = 0


class WorkflowExecutor:
    """Runs rollout episodes in the background under staleness control; see the module docstring."""

    def __init__(self, config: InferenceEngineConfig, engine: InferenceEngine,
                 num_clients: int | None = None) -> None:
        """``num_clients`` (default: the torch.distributed world size, else 1) sets this
        executor's share of the budget."""
        self.config = config
        self.engine = engine
        if num_clients is None:
            import torch.distributed as dist

            num_clients = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if num_clients < 1:
            raise ValueError(f"WorkflowExecutor: num_clients must be >= 1, got {num_clients}")
        self.num_clients = num_clients
        self.max_concurrent = max(1, config.max_concurrent_rollouts // num_clients)
        self.batch_share = max(1, config.consumer_batch_size // num_clients)
        self.stat = RolloutStat()
        self._lock = threading.Lock()
        self._inputs: queue.Queue[tuple[dict[str, Any], RolloutWorkflow]] = queue.Queue(config.queue_size)
        self._outputs: collections.deque[TensorDict] = collections.deque()
        self._held: collections.deque[TensorDict] = collections.deque()  # finished, output buffer full
        self._arrived = threading.Condition(self._lock)
        self._errors: list[BaseException] = []
        self._paused = threading.Event()
        self._exiting = threading.Event()
        self._loop: EventLoopThread | None = None
        self._data_iter: Any = None

    # ------------------------------------------------------------------------------ lifecycle

    def initialize(self) -> None:
        """Start the rollout thread (idempotent)."""
        if self._loop is not None:
            return
        self._exiting.clear()
        self._loop = EventLoopThread(name="awex-fast-rollout")
        asyncio.run_coroutine_threadsafe(self._run(), self._loop.loop)

    def destroy(self) -> None:
        """Stop the rollout thread; running episodes are cancelled."""
        self._exiting.set()
        if self._loop is not None:
            self._loop.stop()
            self._loop = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The rollout thread's event loop (None before `initialize`)."""
        return None if self._loop is None else self._loop.loop

    def pause(self) -> None:
        """Start no new episodes until `resume` (running ones finish)."""
        self._paused.set()

    def resume(self) -> None:
        """Allow new episodes again."""
        self._paused.clear()

    # ------------------------------------------------------------------------------ capacity

    def get_capacity(self) -> int:
        """How many more episodes may start now (may be <= 0)."""
        version = self.engine.get_version()
        with self._lock:
            s = self.stat
            by_staleness = (self.config.max_head_offpolicyness + version + 1) * self.batch_share - (
                s.accepted + s.running)
            return min(self.max_concurrent - s.running, by_staleness)

    async def _run(self) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            while not self._exiting.is_set():
                capacity = 0 if self._paused.is_set() else self.get_capacity()
                while capacity > 0:
                    try:
                        data, workflow = self._inputs.get_nowait()
                    except queue.Empty:
                        break
                    tasks.add(asyncio.create_task(workflow.arun_episode(self.engine, data)))
                    with self._lock:
                        self.stat.submitted += 1
                        self.stat.running += 1
                    capacity -= 1
                if not tasks:
                    await asyncio.sleep(_TICK_S)
                    self._flush_held()
                    continue
                done, tasks = await asyncio.wait(tasks, timeout=_TICK_S, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    self._collect(task)
                self._flush_held()
        finally:
            for task in tasks:
                task.cancel()

    def _collect(self, task: asyncio.Task) -> None:
        with self._lock:
            self.stat.running -= 1
            exc = None if task.cancelled() else task.exception()
            if task.cancelled():
                self.stat.rejected += 1
            elif exc is not None:
                logger.error("rollout episode failed: %r", exc)
                self._errors.append(exc)
            elif task.result() is None:
                self.stat.rejected += 1
            else:
                self.stat.accepted += 1
                self._held.append(task.result())
            self._arrived.notify_all()

    def _flush_held(self) -> None:
        with self._lock:
            while self._held and len(self._outputs) < self.config.queue_size:
                self._outputs.append(self._held.popleft())
            self._arrived.notify_all()

    # ------------------------------------------------------------------------------ user API

    def submit(self, data: dict[str, Any], workflow: RolloutWorkflow) -> None:
        """Queue one episode; raises RuntimeError when the input queue (``queue_size``) is full."""
        if self._loop is None:
            raise RuntimeError("WorkflowExecutor.submit before initialize()")
        try:
            self._inputs.put_nowait((data, workflow))
        except queue.Full:
            raise RuntimeError(f"rollout input queue is full ({self.config.queue_size} items); raise "
                               "InferenceEngineConfig.queue_size or wait() for results first") from None

    def wait(self, count: int, timeout: float | None = None,
             should_accept: Callable[[TensorDict], bool] | None = None) -> TensorDict:
        """``count`` accepted trajectories concatenated (oldest first); see the module docstring."""
        if count < 1:
            raise ValueError(f"wait: count must be >= 1, got {count}")
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        taken: list[TensorDict] = []
        with self._lock:
            while True:
                if self._errors:
                    self._outputs.extendleft(reversed(taken))
                    raise RuntimeError("a rollout episode failed") from self._errors.pop(0)
                while self._outputs and len(taken) < count:
                    traj = self._outputs.popleft()
                    if should_accept is None or should_accept(traj):
                        taken.append(traj)
                    else:
                        self.stat.accepted -= 1
                        self.stat.rejected += 1
                if len(taken) >= count:
                    return concat_padded(taken)
                left = deadline - time.monotonic()
                if left <= 0:
                    self._outputs.extendleft(reversed(taken))
                    raise TimeoutError(f"wait: {len(taken)} of {count} trajectories arrived within "
                                       f"{timeout} s (running {self.stat.running}, accepted "
                                       f"{self.stat.accepted}, capacity bound by version "
                                       f"{self.engine.get_version()})")
                self._arrived.wait(min(left, 0.1))

    def rollout_batch(self, data: list[dict[str, Any]], workflow: RolloutWorkflow,
                      should_accept: Callable[[TensorDict], bool] | None = None) -> TensorDict:
        """Submit every item of ``data`` and wait for as many trajectories."""
        for item in data:
            self.submit(item, workflow)
        return self.wait(len(data), timeout=self.config.request_timeout, should_accept=should_accept)

    def prepare_batch(self, dataloader: Any, workflow: RolloutWorkflow,
                      should_accept: Callable[[TensorDict], bool] | None = None) -> TensorDict:
        """Keep the input queue fed from ``dataloader`` (cycled; it yields lists of dicts) and
        return the next ``dataloader.batch_size`` trajectories."""
        if self._data_iter is None:
            self._data_iter = itertools.cycle(dataloader)
        batch_size = int(dataloader.batch_size)
        while True:
            if (self.get_capacity() + batch_size > 0
                    and self._inputs.qsize() + batch_size <= self.config.queue_size):
                for item in next(self._data_iter):
                    self.submit(item, workflow)
            try:
                return self.wait(batch_size, timeout=1.0, should_accept=should_accept)
            except TimeoutError:
                continue


class RLVRWorkflow(RolloutWorkflow):
    """Prompt -> ``gconfig.n_samples`` completions -> reward -> one padded TensorDict.

    ``data`` holds ``input_ids`` (a token list), or ``messages`` rendered with the tokenizer's
    chat template. ``reward_fn(prompt, completion, prompt_ids, completion_ids, **data)`` (sync
    or async; the strings are None without a tokenizer) returns a float. The result has one row
    per sample: ``input_ids``, ``attention_mask``, ``loss_mask`` (1 on completion tokens),
    ``logprobs`` (0 on prompt tokens), ``versions`` (-1 on prompt tokens) ``[n, L]`` and
    ``rewards`` ``[n]``.
    """

    def __init__(self, reward_fn: Callable[..., Any], gconfig: GenerationHyperparameters,
                 tokenizer: Any = None, enable_thinking: bool = False) -> None:
        """Store the reward function, sampling settings and optional tokenizer."""
        self.reward_fn = reward_fn
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking

    def _prompt_ids(self, data: dict[str, Any]) -> list[int]:
        if "input_ids" in data:
            return [int(t) for t in data["input_ids"]]
        if "messages" in data and self.tokenizer is not None:
            return list(self.tokenizer.apply_chat_template(
                data["messages"], tokenize=True, add_generation_prompt=True,
                enable_thinking=self.enable_thinking))
        raise KeyError("RLVRWorkflow needs data['input_ids'], or data['messages'] and a tokenizer")

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        """Generate ``n_samples`` completions concurrently and score each."""
        prompt = self._prompt_ids(data)
        one = self.gconfig.new(n_samples=1)
        resps = await asyncio.gather(*[engine.agenerate(LLMRequest(input_ids=list(prompt), gconfig=one))
                                       for _ in range(self.gconfig.n_samples)])
        rows = []
        for resp in resps:
            text = self.tokenizer.decode(resp.output_tokens) if self.tokenizer is not None else None
            prompt_text = self.tokenizer.decode(prompt) if self.tokenizer is not None else None
            extra = {k: v for k, v in data.items() if k not in ("input_ids", "messages")}
            reward = self.reward_fn(prompt_text, text, prompt, resp.output_tokens, **extra)
            if inspect.isawaitable(reward):
                reward = await reward
            n_in, n_out = len(prompt), resp.output_len
            rows.append(TensorDict({
                "input_ids": torch.tensor([prompt + resp.output_tokens], dtype=torch.long),
                "attention_mask": torch.ones(1, n_in + n_out, dtype=torch.long),
                "loss_mask": torch.tensor([[0] * n_in + [1] * n_out], dtype=torch.long),
                "logprobs": torch.tensor([[0.0] * n_in + resp.output_logprobs], dtype=torch.float32),
                "versions": torch.tensor([[-1] * n_in + resp.output_versions], dtype=torch.long),
                "rewards": torch.tensor([float(reward)], dtype=torch.float32),
            }, batch_size=[1]))
        return concat_padded(rows)
