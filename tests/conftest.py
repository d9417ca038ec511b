"""Shared test set-up: one torch thread (tiny models run faster without thread hand-offs)."""

import torch

torch.set_num_threads(1)
