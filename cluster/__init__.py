"""Placement groups per rank; launching, scaling, attaching to and removing engine-actor groups."""
