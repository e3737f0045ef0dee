"""Function tools on the HTTP API: what the chat template sees of them (`template`), which requests may
use them and how (`choice`), the model's text parsed into calls as a whole or as it streams (`parsers`),
and those calls in OpenAI's shapes (`calls`)."""
