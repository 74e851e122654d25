"""Training equivalence: mesh, batches, vocab-parallel loss, optimizer, the training step
(one, for the in-process mesh and the gloo ranks), the comparison (and its compiled
read-once loops, ``kernels``), training mutations, adversarial values, collective counts,
and the training and sequence floors.
"""
