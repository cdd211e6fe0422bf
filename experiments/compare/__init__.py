"""The torch baseline: jaxmem against the PyTorch recipe on the same model, weights and batches.

    python -m experiments.compare ...     the comparison (driver.py; see its docstring)

driver: the command (one subprocess per framework x mode x remat); workers: what one subprocess
runs; report: ratios, tables and the chart; torch_llama: the jaxmem Llama as a torch module;
torch_train: the PyTorch training recipe; convert: weights between jaxmem and a Hugging Face
state_dict."""
