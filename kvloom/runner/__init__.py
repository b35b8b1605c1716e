"""The model runner: scheduler output -> tensors -> model -> sampled tokens."""
