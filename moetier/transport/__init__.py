"""Transport: remote expert workers over ZeroMQ.

`protocol` is the whole wire format (msgpack header + raw tensor frames);
`worker` serves experts from its own copy of the weights (ROUTER); `client`
talks to one worker (DEALER: request ids, pipelining, heartbeats, reconnect);
`keys` checks worker endpoints (one parser, ports in range), makes CurveZMQ
key pairs and guards non-loopback binds; `commands` adds `moetier worker`,
`moetier keys gen` and `moetier ping` to the CLI.
Importing this package imports nothing heavy: pyzmq loads with the module
that needs it.
"""
