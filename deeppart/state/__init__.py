"""The state model: a state tree flattened into leaves and back, the safe
encoding of plain values, tensors as bytes and device staging, regions of
sharded tensors and DTensor descriptions, the union of what every rank
holds, each rank's own view of a checkpoint, and key matching on load."""
