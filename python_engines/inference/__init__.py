"""The inference half of the seed engine API: the vLLM-backed engine, and the project's own TP
decoder server with its HTTP client engine.

- `python_engines.inference.vllm_engine`: ``RemotevLLMEngine`` over ``vllm serve`` servers.
- `python_engines.inference.vllm_local`: ``LocalvLLMServer``, its local (in-process) mode.
- `python_engines.inference.model`: Llama/Qwen2/Qwen3 decoder in vLLM's fused per-rank layout.
- `python_engines.inference.server`: ``launch_server`` (worker processes, HTTP on TP rank 0).
- `python_engines.inference.remote`: ``RemoteInferenceEngine`` and ``InferenceEngineConfig``.

Submodules are imported explicitly (``from python_engines.inference.server import
launch_server``), so importing the package stays cheap.
"""

from python_engines.inference.vllm_engine import RemotevLLMEngine as RemotevLLMEngine
