"""The feed wing: a split's molecules -> packed fixed-shape batches, a chunk at a time.

layout (the shapes every batch is built to) -> arrays (a split's data, flat) -> limits (packs
checked against the layout) -> chunk (the memory a chunk of batches is written into) ->
assembly (torch gathers; on the CPU the compiled loop of :mod:`~schnet_ipu.feed.compiled`) ->
dataset (which molecules fill which micro-batch, per epoch) -> loader (host calls, threads).
:mod:`~schnet_ipu.feed.collate` is the readable one-batch reference. The feed reads the data
and packing folders, never training or inference.
"""
