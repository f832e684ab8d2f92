"""LoRA adapters: PEFT adapters read into this rank's slices (adapter.py), and the
worker's host cache and device slots (manager.py). The update itself is computed by the
model's projections (executor/model/lora_slots.py)."""
