"""One `generate`, from the front door to its end: what the node serves its model as (`served`), the
request admitted (`admission`: limits, seeds, the serving request), relayed as it runs (`generation`,
shared by the control socket and the HTTP API) and stopped at a stop string (`stops`)."""
