"""Wire format of `GET /v1/tokenizer`: the served model's tokenizer, as the pod tokenizes, for routers.

A router routes exactly (prompt token ids -> the pod's block hashes) only when it tokenizes as the pod does.
The pod sends the tokenizer it actually runs, serialised by the `tokenizers` library (`Tokenizer.to_str()`),
whatever it was built from: an HF directory's tokenizer.json, or the tokenizer rebuilt from a GGUF file's
metadata (GGUF carries no tokenizer.json). With it go what chat prompts need: the chat template and the
BOS/EOS strings it renders with, and the EOS ids.

`digest` is a sha256 over the content fields (canonical JSON). The pod reports it on `/load` too, so a router
notices a model change without fetching the tokenizer again; the receiver checks it (`verified`).
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict

TOKENIZER_PATH = "/v1/tokenizer"


class TokenizerPayload(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    model: str
    tokenizer_json: str
    eos_token_ids: tuple[int, ...] = ()
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    digest: str = ""

    def content_digest(self) -> str:
        content = self.model_dump(mode="json", exclude={"digest", "model"})
        blob = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()

    def with_digest(self) -> TokenizerPayload:
        return self.model_copy(update={"digest": self.content_digest()})

    def verified(self) -> TokenizerPayload:
        """Itself, when its digest matches its content; ValueError otherwise (a truncated or altered body)."""
        if self.digest != self.content_digest():
            raise ValueError(
                f"tokenizer digest mismatch: announced {self.digest}, content {self.content_digest()}"
            )
        return self
