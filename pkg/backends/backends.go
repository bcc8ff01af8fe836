// Package backends is the one list of the agent's datapath backends: for each, its name, how it
// is built (and so whether it can run on this node, and why not), how it is removed (when
// another backend displaces it, and by `cleanup`), and how `dump` reads what it installed; and
// what --backend auto does with them. The command line takes every backend from here, so a new
// backend is its own package plus one entry of All.
package backends

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Auto is the --backend value that lets the node choose.
const Auto = "auto"

// Options are what the command line gives the backends; each backend reads the fields it uses.
type Options struct {
	// BPFFS is the BPF filesystem the BPF backend pins under (--bpffs).
	BPFFS string
	// Interfaces are the uplinks (--interfaces); empty means the devices of the default routes.
	Interfaces []string
	// EnableIPv6 is --enable-ipv6.
	EnableIPv6 bool
	// AttachMode, SweepInterval and Timeouts are the BPF backend's --attach-mode,
	// --nat-sweep-interval and --nat-timeouts.
	AttachMode    string
	SweepInterval time.Duration
	Timeouts      bpf.Timeouts
	// NATEntries is the BPF backend's --nat-max-entries; 0 means bpf.DefaultNATEntries.
	NATEntries uint32
	// Chain is the iptables backend's chain (--masq-chain).
	Chain string
	// Runner runs the iptables tools; nil runs them on the node (tests give a fake).
	Runner iptables.Runner
	// NFTables are the nftables backend's nft and netlink; zero runs them on the node (tests
	// give a fake). Its Logger is Logger.
	NFTables nftables.Options
	// Logger receives the backends' logs; nil discards them.
	Logger *slog.Logger
}

func (o Options) logger() *slog.Logger {
	if o.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return o.Logger
}

// Backend is one entry of the registry.
type Backend struct {
	// Name is the --backend value, as the backend's datapath.Backend.Name.
	Name string
	// Title names the datapath in messages: "the BPF datapath".
	Title string
	// AutoWhen says when auto takes this backend, for --backend's help ("when the kernel
	// supports it"); the last backend of All takes what the others leave.
	AutoWhen string
	// Fits, when set, says whether auto may take the backend on this node (nil) or why not,
	// beyond whether it can run at all (New); a backend named on the command line is not asked.
	Fits func(ctx context.Context, o Options) error
	// New builds the backend and installs nothing. It probes the node: its error says why the
	// backend cannot run here.
	New func(ctx context.Context, o Options) (datapath.Backend, error)
	// Cleanup removes everything the backend installs, whatever process installed it and with
	// whatever flags; absent state is not an error. It reports what it removed, in a line of
	// `cleanup`'s output.
	Cleanup func(ctx context.Context, o Options) (string, error)
	// Read returns a Reader of each installation of the backend on the node, none when nothing
	// is installed. p is the policy to explain the installed rules with (nil: unknown).
	Read func(ctx context.Context, o Options, p *policy.Policy) ([]datapath.Reader, error)
	// Absent says, when Read finds nothing, where it looked.
	Absent func(o Options) string
	// CountNote, when set, says what the backend's packet counters count, under dump's rules.
	CountNote string
	// Render, when set, is what `render` prints for the backend: the text of the transactions
	// an apply of p from nothing runs. A backend without one has nothing textual to show.
	Render func(p *policy.Policy, o Options) string
}

// All are the backends, in the order --backend auto tries them: auto takes the first that fits
// the node (Fits) and can run on it (whose New succeeds), and logs why it passed over the ones
// before.
var All = []Backend{bpfBackend, nftablesBackend, iptablesBackend}

// Lookup returns the backend named name.
func Lookup(name string) (Backend, bool) {
	for _, b := range All {
		if b.Name == name {
			return b, true
		}
	}
	return Backend{}, false
}

// Names are the backends' names, for messages: "bpf or iptables".
func Names() string { return names(All) }

func names(list []Backend) string {
	names := make([]string, len(list))
	for i, b := range list {
		names[i] = b.Name
	}
	if len(names) == 1 {
		return names[0]
	}
	return strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

// Usage is the help of --backend.
func Usage() string { return usage(All) }

func usage(list []Backend) string {
	var auto []string
	for i, b := range list {
		if i == len(list)-1 {
			auto = append(auto, "else "+b.Name)
		} else {
			auto = append(auto, b.Title+" "+b.AutoWhen)
		}
	}
	return fmt.Sprintf("datapath: %s (%s), %s", Auto, strings.Join(auto, ", "), names(list))
}

// CheckName checks a --backend value.
func CheckName(name string) error {
	if _, ok := Lookup(name); ok || name == Auto {
		return nil
	}
	return fmt.Errorf("backend %q: must be %s, %s", name, Auto, Names())
}

// Chosen is the backend the agent runs, and what goes with it.
type Chosen struct {
	Backend datapath.Backend
	// Displace are the other backends, to remove once Backend holds a policy
	// (agent.Options.Displace).
	Displace []agent.Displaced
	// Changes are the backend's events (such as uplink changes), nil when it has none.
	Changes <-chan string
}

// Close releases what the backend holds (watchers, open maps); the datapath stays installed.
func (c *Chosen) Close() error {
	if cl, ok := c.Backend.(io.Closer); ok {
		return cl.Close()
	}
	return nil
}

// Choose builds the backend that name (a --backend value) selects. Auto tries All in order and
// takes the first that fits and can run here, logging why it passed over the others; a named
// backend that cannot run is an error.
func Choose(ctx context.Context, name string, o Options) (*Chosen, error) {
	if err := CheckName(name); err != nil {
		return nil, err
	}
	log := o.logger().With("component", "backends")
	candidates := All
	if name != Auto {
		b, _ := Lookup(name)
		candidates = []Backend{b}
	}
	// passed are the backends auto passed over, and why, logged once it chose one.
	type passed struct {
		b     Backend
		unfit bool
		err   error
	}
	var skipped []passed
	var err error
	for _, b := range candidates {
		if name == Auto && b.Fits != nil {
			if err = b.Fits(ctx, o); err != nil {
				skipped = append(skipped, passed{b, true, err})
				continue
			}
		}
		var dp datapath.Backend
		if dp, err = b.New(ctx, o); err != nil {
			skipped = append(skipped, passed{b, false, err})
			continue
		}
		for _, s := range skipped {
			if s.unfit {
				log.Info(fmt.Sprintf("the %s datapath does not fit this node; using %s", s.b.Title, b.Name), "reason", s.err)
			} else {
				log.Warn(fmt.Sprintf("the %s datapath cannot run here; using %s", s.b.Title, b.Name), "reason", s.err)
			}
		}
		attrs := []any{"backend", b.Name}
		if r, ok := dp.(datapath.InfoReporter); ok && r.Info().AttachMode != datapath.AttachNone {
			attrs = append(attrs, "attachMode", r.Info().AttachMode)
		}
		log.Info("datapath chosen", attrs...)
		c := &Chosen{Backend: dp, Displace: others(b.Name, o)}
		if ch, ok := dp.(interface{ Changes() <-chan string }); ok {
			c.Changes = ch.Changes()
		}
		return c, nil
	}
	return nil, fmt.Errorf("backend %s: %w", candidates[len(candidates)-1].Name, err)
}

// displaced is a backend another one displaces (agent.Displaced).
type displaced struct {
	b Backend
	o Options
}

func (d displaced) Name() string { return d.b.Name }

func (d displaced) Cleanup(ctx context.Context) error {
	_, err := d.b.Cleanup(ctx, d.o)
	return err
}

// others are every backend but the named one, for it to displace.
func others(name string, o Options) []agent.Displaced {
	var out []agent.Displaced
	for _, b := range All {
		if b.Name != name {
			out = append(out, displaced{b, o})
		}
	}
	return out
}

// Report is what Cleanup did with one backend: a line of what it removed, or why it could not.
type Report struct {
	Backend string
	Removed string
	Err     error
}

// Cleanup removes every backend's state, each whatever the others did.
func Cleanup(ctx context.Context, o Options) []Report {
	out := make([]Report, len(All))
	for i, b := range All {
		removed, err := b.Cleanup(ctx, o)
		out[i] = Report{Backend: b.Name, Removed: removed, Err: err}
	}
	return out
}

// Installed returns a Reader of every installation of every backend, in the order of All, and,
// when there is none, where each backend looked. What one backend fails to read is returned as
// an error next to the others' readers.
func Installed(ctx context.Context, o Options, p *policy.Policy) (readers []datapath.Reader, absent []string, err error) {
	var errs []error
	for _, b := range All {
		rs, err := b.Read(ctx, o, p)
		if err != nil {
			errs = append(errs, err)
		}
		readers = append(readers, rs...)
	}
	if len(readers) == 0 {
		for _, b := range All {
			absent = append(absent, b.Absent(o))
		}
	}
	return readers, absent, errors.Join(errs...)
}
