"""`python -m jaxmem.eval`: the loss, perplexity and target tokens (bits per byte for the byte
tokenizer) of a run's checkpoint or a Hugging Face checkpoint on all of some data (cli.py). The
evaluation itself is the trainer's, jaxmem.train.evaluate, so a run's logged eval_loss and this
command agree on the same weights and batches."""
