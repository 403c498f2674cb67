"""The engine-core clients' transport: the seed's client family and the parts it is made of.

Sockets, the engine set, the HELLO handshake and its driver, the engine monitor, the output
classifier and the loops that drive it, the events that wire the parts. Needs only
`shoal.engine`'s protocol: no Ray, no torch, nothing of `routing/` or `api/`.
"""
