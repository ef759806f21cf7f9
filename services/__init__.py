"""The four rlmesh services; each meets the others only through the protobuf contracts."""
