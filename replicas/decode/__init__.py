"""The decode role (architecture §6): taking migrated KV and stepping the batch (`work`), and receiving one KV
transfer — a whole prompt's or one ZigZag half — into a reservation (`receive`)."""

from replicas.decode.work import DecodeWork

__all__ = ["DecodeWork"]
