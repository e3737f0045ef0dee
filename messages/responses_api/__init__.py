"""The bodies of OpenAI's Responses API, `POST /v1/responses` (docs/http-api.md#the-responses-api):
what a request holds (`requests`) and what the node answers, whole or as stream events (`replies`)."""
