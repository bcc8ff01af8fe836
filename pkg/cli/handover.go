package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/nodelock"
)

// A rollout with maxSurge starts the new pod's agent beside the old one. The new agent knows
// its pod's template generation (--template-generation, from the pod's
// pod-template-generation label) and asks the old holder of the node lock to hand the node
// over (nodelock). The old agent then stops as on SIGTERM (its loop ends, the datapath stays
// in place, its endpoint closes and frees the metrics port) and releases the lock, which the
// new agent takes at its next try; the old process stands by until its pod is deleted, since
// exiting would make the kubelet start it again.

// handOver follows a held lock's handovers for runAgent.
type handOver struct {
	parent, run context.Context
	cancel      context.CancelCauseFunc
}

// handedOver is the cause of the agent's stop when it hands the node over.
type handedOver struct{ to nodelock.Holder }

func (h handedOver) Error() string { return "handed the node over to " + h.to.String() }

// watch returns the context the agent runs in: it ends with ctx, or once lock's holder (this
// agent) has agreed to hand the node over to a newer agent.
func (h *handOver) watch(ctx context.Context, lock *nodelock.Lock, log *slog.Logger) context.Context {
	h.parent = ctx
	h.run, h.cancel = context.WithCancelCause(ctx)
	handOvers := lock.HandOvers()
	go func() {
		select {
		case to := <-handOvers:
			log.Info("a newer agent takes the node over: stopping; the datapath stays in place",
				"component", "cli", "lock", "@"+nodelock.Name, "to", to.String())
			h.cancel(handedOver{to: to})
		case <-h.run.Done():
		}
	}()
	return h.run
}

// standBy runs once everything the agent held is released (the lock, the metrics port, the
// datapath's handles): when it handed the node over, it waits until the process is told to
// stop.
func (h *handOver) standBy(log *slog.Logger) {
	if h.run == nil {
		return // the lock was never held
	}
	defer h.cancel(nil)
	cause, ok := errors.AsType[handedOver](context.Cause(h.run))
	if !ok || h.parent.Err() != nil {
		return
	}
	log.Info("handed the node over; standing by until stopped", "component", "cli", "to", cause.to.String())
	<-h.parent.Done()
}

// parseGeneration reads --template-generation: empty (the label missing, through the downward
// API) is 0, unknown.
func parseGeneration(s string, gen *int64) error {
	if s == "" {
		*gen = 0
		return nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return fmt.Errorf("%q: want the pod's template generation, a number (0 or empty: unknown)", s)
	}
	*gen = n
	return nil
}
