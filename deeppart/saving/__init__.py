"""The save's stages: planning (and the plan cache), prepare (the state
agreed, replicas proved), the writer, the metadata of a commit, snapshots
for async saves and the saves in flight."""
