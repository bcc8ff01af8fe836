// Package backends is the registry: the one list of the agent's datapath backends (each
// package's datapath.Entry: its name, flags, how it is built, removed and read) and what
// --backend auto does with them. The command line takes every backend from here, so a new
// backend is its own package plus one line of All.
package backends

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpfbackend"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/uplink"
)

// All are the backends, in the order --backend auto tries them: auto takes the first that fits
// the node (Entry.Fits) and can run on it (whose New succeeds), and logs why it passed over the
// ones before.
var All = []datapath.Entry{bpfbackend.Entry, nftables.Entry, iptables.Entry}

// Auto is the --backend value that lets the node choose.
const Auto = "auto"

// Options are what the command line gives the backends: the settings they share, and each
// one's own.
type Options struct {
	// Interfaces are the uplinks (--interfaces); empty means the devices pod traffic leaves by.
	Interfaces []string
	// Logger receives the backends' logs; nil discards them.
	Logger *slog.Logger
	// Settings are each backend's own (RegisterFlags); a backend without any gets the defaults
	// of its flags.
	Settings Settings
}

// Settings are the backends' own settings, by backend name.
type Settings map[string]datapath.Settings

// RegisterFlags registers every backend's own flags on fs, and returns the settings they parse
// into. group is called around each backend's registration, with a title for its flags in the
// help.
func RegisterFlags(fs *flag.FlagSet, group func(title string, register func())) Settings {
	s := Settings{}
	for _, b := range All {
		if b.Flags != nil {
			group(b.Title+" backend", func() { s[b.Name] = b.Flags(fs) })
		}
	}
	return s
}

// Check validates the options: --interfaces, and each backend's own settings.
func (o Options) Check() error {
	if err := uplink.CheckInterfaces(o.Interfaces); err != nil {
		return err
	}
	return o.Settings.Check()
}

// Check validates each backend's settings (the bounds of its flags).
func (s Settings) Check() error {
	for _, b := range All {
		if own := s[b.Name]; own != nil {
			if err := own.Check(); err != nil {
				return err
			}
		}
	}
	return nil
}

// env is what b's functions are given under o.
func (o Options) env(b datapath.Entry) datapath.Env {
	e := datapath.Env{Interfaces: o.Interfaces, Logger: o.Logger, Own: o.Settings[b.Name]}
	if e.Logger == nil {
		e.Logger = slog.New(slog.DiscardHandler)
	}
	if e.Own == nil && b.Flags != nil {
		e.Own = b.Flags(flag.NewFlagSet(b.Name, flag.ContinueOnError))
	}
	return e
}

// Lookup returns the backend named name.
func Lookup(name string) (datapath.Entry, bool) {
	for _, b := range All {
		if b.Name == name {
			return b, true
		}
	}
	return datapath.Entry{}, false
}

// Names are the backends' names, for messages: "bpf or iptables".
func Names() string { return names(All) }

func names(list []datapath.Entry) string {
	names := make([]string, len(list))
	for i, b := range list {
		names[i] = b.Name
	}
	return orList(names)
}

// orList joins items as "a, b or c".
func orList(items []string) string {
	if len(items) == 1 {
		return items[0]
	}
	return strings.Join(items[:len(items)-1], ", ") + " or " + items[len(items)-1]
}

// Usage is the help of --backend.
func Usage() string { return usage(All) }

func usage(list []datapath.Entry) string {
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

// Installs says what the backends install, for cleanup's description: "the BPF programs and
// pins, the nftables tables, ...".
func Installs() string {
	var out []string
	for _, b := range All {
		out = append(out, b.Installs)
	}
	return strings.Join(out, ", ")
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
	Displace []datapath.Displaced
	// Changes are the backend's events, such as uplink changes (datapath.ChangeReporter); nil when
	// it has none.
	Changes <-chan string
	// Reason says why this backend runs: named by --backend, or what auto found of the
	// backends it passed over.
	Reason string
	// CannotRun names the backends auto would have taken over this one but passed over because
	// they cannot run on this node (not those that merely do not fit it): a fallback runs.
	CannotRun []string
}

// Close releases what the backend holds (watchers, open maps); the datapath stays installed.
func (c *Chosen) Close() error {
	if cl, ok := c.Backend.(io.Closer); ok {
		return cl.Close()
	}
	return nil
}

// Choose builds the backend that name (a --backend value) selects. Auto tries All in order and
// takes the first that fits and can run here, else the first that runs of those it passed over
// as unfit, logging why it passed over the others; a named backend that cannot run is an error.
func Choose(ctx context.Context, name string, o Options) (*Chosen, error) {
	if err := CheckName(name); err != nil {
		return nil, err
	}
	candidates := All
	if name != Auto {
		b, _ := Lookup(name)
		candidates = []datapath.Entry{b}
	}
	c := chooser{o: o, log: o.logger().With("component", "backends"), auto: name == Auto}
	var unfit []datapath.Entry
	for _, b := range candidates {
		if name == Auto && b.Fits != nil {
			if err := b.Fits(ctx, o.env(b)); err != nil {
				c.passed = append(c.passed, passed{b, true, err})
				unfit = append(unfit, b)
				continue
			}
		}
		if chosen := c.take(ctx, b); chosen != nil {
			return chosen, nil
		}
	}
	for _, b := range unfit {
		if chosen := c.take(ctx, b); chosen != nil {
			return chosen, nil
		}
	}
	return nil, errors.Join(c.errs...)
}

// chooser is what Choose has tried.
type chooser struct {
	o      Options
	auto   bool
	log    *slog.Logger
	passed []passed
	errs   []error
}

// passed is a backend auto passed over, and why, logged once it chose one.
type passed struct {
	b     datapath.Entry
	unfit bool
	err   error
}

// take builds b: the backend chosen, with the backends passed over logged; or nil, with b
// passed over and its error kept.
func (c *chooser) take(ctx context.Context, b datapath.Entry) *Chosen {
	dp, err := b.New(ctx, c.o.env(b))
	if err != nil {
		c.passed = append(c.passed, passed{b, false, err})
		c.errs = append(c.errs, fmt.Errorf("backend %s: %w", b.Name, err))
		return nil
	}
	// A backend that cannot run is a warning where auto would have taken it over b: one
	// ahead of b in All. Those after b were tried only because b does not fit.
	ahead := func(x datapath.Entry) bool {
		return slices.IndexFunc(All, func(e datapath.Entry) bool { return e.Name == x.Name }) <
			slices.IndexFunc(All, func(e datapath.Entry) bool { return e.Name == b.Name })
	}
	for _, s := range c.passed {
		switch {
		case s.b.Name == b.Name:
		case s.unfit:
			c.log.Info(fmt.Sprintf("the %s datapath does not fit this node; using %s", s.b.Title, b.Name), "reason", s.err)
		case ahead(s.b):
			c.log.Warn(fmt.Sprintf("the %s datapath cannot run here; using %s", s.b.Title, b.Name), "reason", s.err)
		default:
			c.log.Info(fmt.Sprintf("the %s datapath cannot run here; using %s", s.b.Title, b.Name), "reason", s.err)
		}
	}
	for _, s := range c.passed {
		if s.unfit && s.b.Name == b.Name {
			c.log.Info(fmt.Sprintf("the %s datapath does not fit this node, but no backend that fits can run: using it", s.b.Title), "reason", s.err)
		}
	}
	attrs := []any{"backend", b.Name}
	if r, ok := dp.(datapath.InfoReporter); ok && r.Info().AttachMode != datapath.AttachNone {
		attrs = append(attrs, "attachMode", r.Info().AttachMode)
	}
	c.log.Info("datapath chosen", attrs...)
	chosen := &Chosen{Backend: dp, Displace: others(b.Name, c.o), Reason: "--backend=" + b.Name}
	if c.auto {
		chosen.Reason = "auto: the first backend that fits and runs here"
		var why []string
		for _, s := range c.passed {
			switch {
			case s.b.Name == b.Name:
			case s.unfit:
				why = append(why, fmt.Sprintf("%s does not fit: %v", s.b.Name, s.err))
			default:
				why = append(why, fmt.Sprintf("%s cannot run: %v", s.b.Name, s.err))
				if ahead(s.b) {
					chosen.CannotRun = append(chosen.CannotRun, s.b.Name)
				}
			}
		}
		if len(why) > 0 {
			chosen.Reason = "auto: " + strings.Join(why, "; ")
		}
	}
	if ch, ok := dp.(datapath.ChangeReporter); ok {
		chosen.Changes = ch.Changes()
	}
	return chosen
}

func (o Options) logger() *slog.Logger {
	if o.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return o.Logger
}

// displaced is a backend another one displaces (datapath.Displaced).
type displaced struct {
	b datapath.Entry
	o Options
}

func (d displaced) Name() string { return d.b.Name }

func (d displaced) Cleanup(ctx context.Context) error {
	_, err := d.b.Cleanup(ctx, d.o.env(d.b))
	return err
}

// others are every backend but the named one, for it to displace.
func others(name string, o Options) []datapath.Displaced {
	var out []datapath.Displaced
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
		removed, err := b.Cleanup(ctx, o.env(b))
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
		rs, err := b.Read(ctx, o.env(b), p)
		if err != nil {
			errs = append(errs, err)
		}
		readers = append(readers, rs...)
	}
	if len(readers) == 0 {
		for _, b := range All {
			absent = append(absent, b.Absent(o.env(b)))
		}
	}
	return readers, absent, errors.Join(errs...)
}

// Renderer is what `render` prints for the backend named name (Entry.Render), and false when
// it has nothing textual to show.
func Renderer(name string) (func(p *policy.Policy, o Options) string, bool) {
	b, ok := Lookup(name)
	if !ok || b.Render == nil {
		return nil, false
	}
	return func(p *policy.Policy, o Options) string { return b.Render(p, o.env(b)) }, true
}

// RenderDefault is the backend `render` prints by default: the iptables payload, as the upstream
// agent writes it.
const RenderDefault = iptables.Name

// Renderable names the backends Render prints: "iptables or nftables".
func Renderable() string {
	var list []string
	for _, b := range All {
		if b.Render != nil {
			list = append(list, b.Name)
		}
	}
	return orList(list)
}
