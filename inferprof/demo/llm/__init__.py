"""The LLM demo: a numpy decoder with a paged KV cache, a continuous-batching scheduler
with chunked prefill and recompute preemption, and an OpenAI-style streaming endpoint.

``inferprof demo --workload llm`` runs it; see docs/demo.md, "The LLM demo".
"""
