"""Steps as a line: the lineage of a checkpoint root's steps, in a
directory and in an object store."""
