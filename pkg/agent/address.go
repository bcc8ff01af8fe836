package agent

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"slices"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// checkAddresses checks the masquerade addresses of p, the policy of the configuration a reload
// found, against the node's, and those of the policy in force as well when p is another one
// that fails; it returns p's error. The policy in force keeps its addresses when they go away
// (the last good state): what is missing shows in Stats.MissingAddresses, and while the policy
// in force lacks one /readyz fails and the log says so once.
func (a *Agent) checkAddresses(ctx context.Context, st *loopState, p *policy.Policy, log *slog.Logger) error {
	names := len(p.Addresses()) > 0
	inForceNames := st.desired != nil && len(st.desired.Addresses()) > 0
	var err, inForce error
	if a.opts.Addresses != nil && (names || inForceNames) {
		err = a.opts.Addresses.Check(ctx, p)
		switch {
		case p == st.desired:
			inForce = err
		case err != nil && st.desired != nil:
			inForce = a.opts.Addresses.Check(ctx, st.desired)
		}
	}
	// A change of the uplinks' addresses matters while p names some (in force or waiting for
	// them), or p is rejected and the policy in force names some.
	st.addresses = names || err != nil && inForceNames
	missing := slices.SortedFunc(slices.Values(append(missingAddresses(err), missingAddresses(inForce)...)), netip.Addr.Compare)
	gone := ""
	if inForce != nil {
		gone = inForce.Error()
	}
	a.mu.Lock()
	was := a.addrGone
	a.addrGone, a.stats.MissingAddresses = gone, slices.Compact(missing)
	a.mu.Unlock()
	switch {
	case gone != "" && gone != was:
		log.Error("a masquerade address of the configuration in force is not on the node; its policy stays in place, "+
			"and traffic masqueraded to the address gets no replies until it is back; not ready while it lasts", "error", inForce)
	case gone == "" && was != "":
		log.Info("the masquerade addresses of the configuration in force are on the node again")
	}
	return err
}

// missingAddresses are the addresses an AddressChecker's error says the node lacks.
func missingAddresses(err error) []netip.Addr {
	if m, ok := errors.AsType[interface {
		error
		MissingAddresses() []netip.Addr
	}](err); ok {
		return m.MissingAddresses()
	}
	return nil
}
