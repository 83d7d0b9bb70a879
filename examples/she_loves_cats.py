# SPDX-License-Identifier: MIT
"""The seed example from Python: embed "she loves cats", run two attention heads, print and plot
the attention weights.

    pip install ./python            # or: MHA_LIBRARY=build/libmha.so PYTHONPATH=python
    python3 examples/she_loves_cats.py [out.png]

Each word gets a small hand-made embedding (3 features) and the layer has two heads whose
projections are written out by hand so the result can be read: head 0 lets every word look at
itself and the words before it (causal); head 1 makes "she" and "cats" look at "loves" (the
verb links subject and object). The weights are printed as tables and, when matplotlib is
installed, drawn as heatmaps with the words as labels (attention.png by default).
"""
import os
import sys

import numpy as np

try:
    import mha  # the installed package (pip install ./python)
except ImportError:  # not installed: the checkout's python/ (with MHA_LIBRARY=build/libmha.so)
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import mha

tokens = ["she", "loves", "cats"]
# Embeddings: [pronoun, verb, noun] features, one row per word.
x = np.array([[[1.0, 0.0, 0.2],
               [0.0, 1.0, 0.0],
               [0.1, 0.0, 1.0]]], dtype=np.float32)  # [B=1, n=3, d=3]

d_model, heads, d_k = 3, 2, 2
# nn.Linear layout [h*d_k, d_model]: rows 0-1 are head 0, rows 2-3 head 1.
w_q = np.array([[2, 2, 2], [0, 0, 0],      # head 0: a word looks at words sharing its features ...
                [3, 0, 3], [0, 0, 0]],     # head 1: nouns and pronouns ask for the verb
               dtype=np.float32)
w_k = np.array([[1, 1, 1], [0, 0, 0],      # ... (causal: itself and earlier words)
                [0, 3, 0], [0, 0, 0]],     # head 1: the verb answers
               dtype=np.float32)
w_v = np.eye(4, 3, dtype=np.float32)       # values: the first two features per head
w_o = np.eye(3, 4, dtype=np.float32)

layer = mha.MultiheadAttention(w_q, w_k, w_v, w_o, num_heads=heads)
causal = np.tril(np.ones((3, 3), bool))
y, weights = layer(x, mask=np.stack([causal, np.ones((3, 3), bool)])[None],
                   need_weights=True)        # head 0 causal, head 1 sees everything

np.set_printoptions(precision=3, suppress=True)
for h in range(heads):
    print(f"head {h} (rows: queries, columns: keys)")
    print("         " + "".join(f"{t:>8}" for t in tokens))
    for i, t in enumerate(tokens):
        print(f"{t:>8} " + "".join(f"{p:8.3f}" for p in weights[0, h, i]))
print("output y [3, 3]:")
print(y[0])

path = sys.argv[1] if len(sys.argv) > 1 else "attention.png"
try:
    mha.plot_attention(weights[0], tokens, path=path, title='"she loves cats"')
    print(f"wrote {path}")
except ImportError as e:
    print(f"(no plot: {e})")
