"""LoRA adapters on shoal's engine: the flags (`config`), PEFT adapter folders read and checked
against a base model (`adapter`), which adapters hold the rank's live slots and its CPU memory
(`slots`), and what the scheduler asks about requests' adapters (`requests`).

How the adapters' matrices enter the forward pass is the model's business
(`shoal.engine.model.lora_layers`). Importing this package does not import torch.
"""
