"""`WeightSource`s the vLLM tests train with, as vLLM users write them: a dict of tensors the
trainer replaces between steps, and a safetensors checkpoint streamed from disk and re-published
with ``os.replace``; and the trainer side those tests share (an FSDP2 model from a checkpoint,
one training step, the oracle checkpoint, a rank stalled mid-round). Import only after
``pytest.importorskip("vllm")``."""

from __future__ import annotations

import os
import shutil
import time

from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource


class DictSource(WeightSource):
    """A `WeightSource` over a dict of tensors, which the trainer replaces between rounds."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors

    def metadata(self) -> list:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def __iter__(self):
        yield from self.tensors.items()


class CheckpointSource(WeightSource):
    """Streams a safetensors file, opened again on every pass (so a re-published file is seen)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def metadata(self) -> list:
        import torch
        from safetensors import safe_open

        dtypes = {"F32": torch.float32, "BF16": torch.bfloat16}
        with safe_open(self.path, framework="pt") as f:
            return [ParamMeta(n, dtypes[f.get_slice(n).get_dtype()], tuple(f.get_slice(n).get_shape()))
                    for n in f.keys()]  # noqa: SIM118 - safe_open is not iterable

    def __iter__(self):
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            for n in f.keys():  # noqa: SIM118 - safe_open is not iterable
                yield n, f.get_tensor(n)


def publish(state: dict, path: str) -> None:
    """Write a checkpoint as a checkpoint writer does: readers see the old or the new file."""
    from safetensors.torch import save_file

    tmp = path + ".tmp"
    save_file(state, tmp)
    os.replace(tmp, path)


def save_bf16(state: dict, config_dir: str, out: str) -> None:
    """The oracle checkpoint of ``state`` in the served dtype (bfloat16), with the model's config."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(config_dir, "config.json"), out)
    save_file({n: t.to(torch.bfloat16).contiguous() for n, t in state.items()},
              os.path.join(out, "model.safetensors"))


def train_step(model, opt, seed: int) -> dict:
    """One optimizer step of ``model`` (FSDP2, causal LM) on a batch drawn from ``seed``; returns
    every parameter as its full tensor (a collective: every rank calls it), the round's oracle."""
    import torch

    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def fsdp2_model(model_dir: str):
    """The checkpoint in ``model_dir`` as a float32 transformers model under FSDP2 (each decoder
    layer, then the root), over the default process group."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def stall_next_send(adapter, seconds: float) -> None:
    """Fault injection: this rank's next transfer starts ``seconds`` late (a rank stalled
    mid-round: a long GC pause, a swapped-out process), then runs for real."""
    real = adapter.execute_weight_update

    def late(version: int):
        adapter.execute_weight_update = real
        time.sleep(seconds)
        return real(version)

    adapter.execute_weight_update = late
