"""OpenAI's Responses API (`POST /v1/responses`) over the chat-completion path: a request becomes chat
messages (`turn`), runs as a chat completion does, and its outcome becomes a response, whole or as
events (`output`); stored responses let the next request continue from them (`store`)."""
