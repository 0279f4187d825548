"""Real data: documents read from each source (`documents`), tokenized (`tokenizer`),
packed into rows (`packing`, pure NumPy), and the token cache, grain batches and the rows
each process reads (`loader`). Knows nothing of the model or the pipeline.
"""
