"""OpenAI wire types and their translation into engine inputs: the one vocabulary server and router share.

The server answers these requests and the router reads them (to hash prompt blocks for prefix affinity);
neither imports the other, both import this package.
"""
