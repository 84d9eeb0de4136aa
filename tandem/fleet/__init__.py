"""The inference fleet as a whole: its operations (`ops`), how each server kind serves them
(`adapters`), the `Fleet` interface (`interface`), the direct HTTP fleet (`http`) and the JSON
wire form of requests and answers (`wire`). Control plane only: no tensors, no torch."""
