"""The simulated GPU replica: prefix cache, continuous-batching engine, HTTP face.

`cache` and `engine` run in whatever clock their caller passes (virtual time in the fleet
simulator, scaled real time in `server`); `server` and `cli` make it look like a vLLM or
SGLang server on the network.
"""
