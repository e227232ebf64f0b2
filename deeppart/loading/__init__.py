"""The load's stages: the reader (plain leaves: open, plan reads, read,
exchange, assemble), resharding of DTensors to any mesh, and group
selections."""
