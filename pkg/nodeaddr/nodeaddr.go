// Package nodeaddr checks that the masquerade addresses of a policy are the node's own, on the
// uplinks their destinations leave by (package uplink: the devices of the routes toward what
// the policy masquerades, or --interfaces), and follows the uplinks' addresses through
// netlink: the agent's AddressChecker, the same for every backend.
package nodeaddr

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/uplink"
)

// Checker is an agent.AddressChecker. Create it with New, run Watch, and Close it after.
type Checker struct {
	// res is Check's resolver, watchRes Watch's: a netlink handle serves one caller at a time.
	res, watchRes *uplink.Resolver
	log           *slog.Logger
	changes       chan string
}

var _ agent.AddressChecker = (*Checker)(nil)

// New returns a checker of the uplinks named by interfaces (the devices of the default routes
// when empty), in the network namespace of the calling thread. It watches nothing until Watch.
func New(interfaces []string, log *slog.Logger) (*Checker, error) {
	res, err := uplink.NewResolver(interfaces)
	if err != nil {
		return nil, err
	}
	watchRes, err := uplink.NewResolver(interfaces)
	if err != nil {
		res.Close()
		return nil, err
	}
	return &Checker{res: res, watchRes: watchRes, log: log, changes: make(chan string, 1)}, nil
}

// Watch follows the uplinks' addresses, reporting each change on Changes, until ctx ends. Its
// netlink subscriptions are made in the namespace of the thread it runs on.
func (c *Checker) Watch(ctx context.Context) { uplink.Watch(ctx, c.watchRes, c.changed, c.log) }

// changed reports a change of the uplinks; while one waits, later ones are dropped (the check
// it leads to reads the uplinks anew).
func (c *Checker) changed(reason string, _ uplink.Set) {
	select {
	case c.changes <- reason:
	default:
	}
}

// Changes implements agent.AddressChecker.
func (c *Checker) Changes() <-chan string { return c.changes }

// Check implements agent.AddressChecker: it reads the uplinks and their addresses now (when p
// names masquerade addresses; else it reads nothing), with the routes that make uplinks under
// p, which say where each address's destinations leave by.
func (c *Checker) Check(ctx context.Context, p *policy.Policy) error {
	uses := p.Addresses()
	if len(uses) == 0 {
		return nil
	}
	c.res.SetScope(p.MayMasquerade)
	c.watchRes.SetScope(p.MayMasquerade)
	set, err := c.res.Resolve(ctx)
	if err != nil {
		return fmt.Errorf("check the masquerade addresses against the uplinks: %w", err)
	}
	return Missing(uses, set)
}

// Missing returns nil when every address of uses is one of an uplink that its destinations
// leave by (uplink.Set.LeavesBy of each of its To; any uplink where no uplink's route holds
// them, such as devices --interfaces names that no route goes by, or a use without To), else a
// *MissingError naming those that are not.
func Missing(uses []policy.AddressUse, set uplink.Set) error {
	e := &MissingError{Uplinks: set}
	for _, u := range uses {
		if where, ok := onDevice(u, set); !ok {
			e.Uses, e.Where = append(e.Uses, u), append(e.Where, where)
		}
	}
	if len(e.Uses) == 0 {
		return nil
	}
	return e
}

// onDevice tells whether u's address is on the uplinks its destinations leave by; where it is
// on another uplink only, it says which they are ("" where no uplink has it).
func onDevice(u policy.AddressUse, set uplink.Set) (string, bool) {
	has := func(up uplink.Uplink) bool { return slices.Contains(set.Addrs[up.Index], u.Addr) }
	if !slices.ContainsFunc(set.Uplinks, has) {
		return "", false
	}
	for _, to := range u.To {
		by := set.LeavesBy(to)
		if len(by) == 0 || slices.ContainsFunc(by, has) {
			continue
		}
		names := make([]string, len(by))
		for i, up := range by {
			names[i] = up.Name
		}
		return strings.Join(names, " or ") + ", which " + to.String() + " leaves by", false
	}
	return "", true
}

// Close releases the netlink handles; Watch must have returned.
func (c *Checker) Close() {
	c.res.Close()
	c.watchRes.Close()
}

// MissingError is masquerade addresses that are not the node's, on the uplinks their
// destinations leave by.
type MissingError struct {
	// Uses are the addresses, with the configuration's part that names each.
	Uses []policy.AddressUse
	// Where are, for each of Uses, the uplinks it was looked for on, when they are not all of
	// them: "uplink2, which 198.18.0.0/15 leaves by".
	Where []string
	// Uplinks are the uplinks as they were read, with their addresses.
	Uplinks uplink.Set
}

func (e *MissingError) Error() string {
	var anywhere, phrases []string
	for i, u := range e.Uses {
		if i < len(e.Where) && e.Where[i] != "" {
			phrases = append(phrases, u.String()+" is not an address of "+e.Where[i])
			continue
		}
		anywhere = append(anywhere, u.String())
	}
	if len(anywhere) > 0 {
		what := "is not an address"
		if len(anywhere) > 1 {
			what = "are not addresses"
		}
		phrases = append([]string{strings.Join(anywhere, ", ") + " " + what + " of the node's uplinks"}, phrases...)
	}
	return fmt.Sprintf("%s (%s)", strings.Join(phrases, "; "), e.uplinks())
}

// uplinks shows the uplinks and their addresses: "uplink: 10.0.0.10, 10.0.0.11".
func (e *MissingError) uplinks() string {
	if len(e.Uplinks.Uplinks) == 0 {
		if len(e.Uplinks.Missing) > 0 {
			return "none of --interfaces " + strings.Join(e.Uplinks.Missing, ",") + " exists"
		}
		return "the node has no uplink: no default route, and no route toward a masqueraded destination"
	}
	var out []string
	for _, u := range e.Uplinks.Uplinks {
		addrs := make([]string, len(e.Uplinks.Addrs[u.Index]))
		for i, a := range e.Uplinks.Addrs[u.Index] {
			addrs[i] = a.String()
		}
		if len(addrs) == 0 {
			addrs = []string{"no address"}
		}
		out = append(out, u.Name+": "+strings.Join(addrs, ", "))
	}
	return strings.Join(out, "; ")
}

// MissingAddresses are the addresses (see agent.AddressChecker).
func (e *MissingError) MissingAddresses() []netip.Addr {
	out := make([]netip.Addr, len(e.Uses))
	for i, u := range e.Uses {
		out[i] = u.Addr
	}
	return out
}
