"""LoRA adapters and int8 / NF4 quantized frozen bases (QLoRA), through the projection seam."""
