"""The encode role (architecture §1, §5): run the vision encoder on a request's images and send the rows
to the prefill replica holding it (`work`)."""

from replicas.encode.work import EncodeJob, EncodeWork

__all__ = ["EncodeJob", "EncodeWork"]
