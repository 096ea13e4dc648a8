# SPDX-License-Identifier: Apache-2.0
"""The model and gradients of the elastic tests (test_torch_elastic.py on one host,
tests/multihost/torch_elastic.py across hosts): a run that lost ranks is compared bit for bit with
one that did not."""
import numpy as np
import torch


def net():
    # Weights from a generator of its own: ranks that are threads would otherwise draw from torch's
    # one global generator in turns, and rank 0's model (which every rank starts from) would vary.
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy((rng.standard_normal(p.shape) * 0.3).astype(np.float32)))
    return model


def exact_grad(step, shape, salt):
    # Multiples of 1/256, the same on every rank: their mean over any number of ranks is exact, so
    # runs on different numbers of ranks step through the same bits.
    n = int(np.prod(shape))
    g = ((np.arange(n) * 7 + step * 13 + salt * 5) % 17 - 8) / 256
    return torch.from_numpy(g.astype(np.float32)).reshape(shape)
