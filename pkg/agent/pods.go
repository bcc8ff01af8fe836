package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// errPodsUnknown marks a configuration that waits for its selected pods (Options.Pods).
var errPodsUnknown = errors.New("the configuration selects pods, which are not known yet")

// defaultNoPods is the hint of Options.NoPods when it says nothing.
const defaultNoPods = "the agent runs without the API server"

// policyOptions are what cfg's policy compiles with: Options.PolicyOptions with the addresses
// of the pods its selector rules choose, and when the event that last changed them arrived. The
// error is a configuration to reject when it selects pods and there is no Pods; it wraps
// errPodsUnknown while Pods cannot tell them yet.
func (a *Agent) policyOptions(cfg config.Config) (policy.Options, time.Time, error) {
	opts := a.opts.PolicyOptions
	if a.opts.Pods == nil {
		return opts, time.Time{}, noPods(cfg, a.opts.NoPods)
	}
	pods, since, err := a.opts.Pods.Select(cfg.SourceRules)
	if err != nil {
		return opts, since, fmt.Errorf("%w: %w", errPodsUnknown, err)
	}
	opts.Pods = pods
	return opts, since, nil
}

// noPods is the error of a configuration whose rules select pods, which the agent cannot know
// without the API server: one problem per such rule, at its first selector; nil when none does.
func noPods(cfg config.Config, why string) error {
	if why == "" {
		why = defaultNoPods
	}
	var errs []error
	for i, r := range cfg.SourceRules {
		if !r.Selects() {
			continue
		}
		field, sel := "namespaceSelector", r.NamespaceSelector
		if sel == nil {
			field, sel = "podSelector", r.PodSelector
		}
		errs = append(errs, &config.FieldError{Key: config.RuleLabel(i, r.Name) + "." + field, Index: -1,
			Value: metav1.FormatLabelSelector(sel), Problem: "selects pods, which needs the API server", Hint: why})
	}
	return errors.Join(errs...)
}

// followInForce makes Options.Pods follow the rules of the configuration in force (again, when
// a refused one's were followed) and gives its policy the pods they choose now: a change of
// them must reach the datapath while the configuration cannot be read, or is refused. It
// returns true when the policy changed (st.desired is then the one to apply).
func (a *Agent) followInForce(st *loopState) bool {
	if a.opts.Pods == nil {
		return false
	}
	pods, since, err := a.opts.Pods.Select(st.desiredConfig.SourceRules)
	if err != nil || st.desired == nil {
		return false
	}
	opts := a.opts.PolicyOptions
	opts.Pods = pods
	p := policy.Compile(st.desiredConfig, opts)
	if p.Equal(st.desired) {
		return false
	}
	st.desired = p
	st.podsChanged(since)
	return true
}

// podsChanged records that the desired policy holds pods an event that arrived at since changed.
func (st *loopState) podsChanged(since time.Time) {
	if !since.IsZero() && (st.podsSince.IsZero() || since.Before(st.podsSince)) {
		st.podsSince = since
	}
}

// podsApplied reports, after the desired policy was applied, how long its pods took from their
// event.
func (a *Agent) podsApplied(st *loopState, log *slog.Logger) {
	if st.podsSince.IsZero() {
		return
	}
	took := time.Since(st.podsSince)
	st.podsSince = time.Time{}
	if o, ok := a.opts.Observer.(PodsObserver); ok {
		o.ObservePodsApplied(took)
	}
	log.Info("the selected pods are in the datapath", "sincePodEvent", took)
}
