"""orthoptim inside the trainers people already use (docs/integrations.md).

One small module a framework, each importing its framework only when imported itself:
`orthoptim.integrations.hf` (Hugging Face Trainer), `.lightning`, `.torchtitan`. accelerate
needs no module: its documented loop (`accelerator.prepare(model, opt, loader)`, `accumulate`,
`clip_grad_norm_`, `save_state(...)`) takes every orthoptim optimizer.
Install the framework with the extra of the same name, e.g. `pip install 'orthoptim[lightning]'`.
"""
