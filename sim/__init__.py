"""Fleet simulator and capacity planner: the real scheduler, KV cache, router scorers and autoscaling policy on
a virtual clock, with only the model forward replaced by a cost model. Nothing in tokenfleet imports this
package; `tokenfleet simulate` reaches it through a lazy import."""
