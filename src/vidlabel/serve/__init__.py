"""The classify stage: the vLLM servers, the client, errors, the journal of answers, the pilot."""
