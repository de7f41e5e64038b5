"""orthoptim inside the trainers people already use (docs/integrations.md).

One small module a framework, each importing its framework only when imported itself:
`orthoptim.integrations.hf` (Hugging Face Trainer), `.accelerate`, `.lightning`, `.torchtitan`.
Install the framework with the extra of the same name, e.g. `pip install 'orthoptim[lightning]'`.
"""
