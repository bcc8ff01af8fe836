package datapath

import (
	"context"
	"flag"
	"log/slog"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Entry is a backend as the registry (package backends) lists it: everything the command line
// and the agent need to know of it, so that nothing outside the backend's own package names what
// is behind it. A new backend is a package that defines its Entry, plus one line of the
// registry's list.
type Entry struct {
	// Name is the --backend value, as the backend's Backend.Name.
	Name string
	// Title names the datapath in messages ("the BPF datapath") and its flags' group in --help.
	Title string
	// AutoWhen says when --backend auto takes this backend, for --backend's help ("when the
	// kernel supports it"); the last entry of the registry takes what the others leave.
	AutoWhen string
	// Installs says what the backend installs, for cleanup's description ("the BPF programs
	// and pins").
	Installs string
	// Counts, when set, says what the backend's packet counters count when it is not every
	// packet ("connections: the first packet of each"), for dump's notes and the metrics' help.
	Counts string
	// DriftKinds are the kinds of drift the backend's CheckDrift reports that an apply repairs
	// (DriftChecker.DriftKinds), for the heals metric's help.
	DriftKinds []string

	// Flags, when set, registers the backend's own flags on fs, each with its default and, in
	// its help, its bounds, and returns what they parse into: Settings.Check validates them
	// once parsed. Registering on a flag set that is never parsed gives the defaults.
	Flags func(fs *flag.FlagSet) Settings
	// Fits, when set, says whether auto may take the backend on this node ahead of the
	// entries after it (nil), or why not; auto still takes it, after them, when none of them
	// can run. A backend named on the command line is not asked.
	Fits func(ctx context.Context, e Env) error
	// New builds the backend and installs nothing. It probes the node: its error says why the
	// backend cannot run here.
	New func(ctx context.Context, e Env) (Backend, error)
	// Cleanup removes everything the backend installs, whatever process installed it and with
	// whatever flags; absent state is not an error. It reports what it removed, in a line of
	// `cleanup`'s output.
	Cleanup func(ctx context.Context, e Env) (string, error)
	// Read returns a Reader of each installation of the backend on the node, none when nothing
	// is installed. p is the policy to explain the installed rules with (nil: unknown).
	Read func(ctx context.Context, e Env, p *policy.Policy) ([]Reader, error)
	// Absent says, when Read finds nothing, where it looked.
	Absent func(e Env) string
	// Render, when set, is what `render` prints for the backend: the text of the transactions
	// an apply of p from nothing runs. A backend without one has nothing textual to show.
	Render func(p *policy.Policy, e Env) string
}

// Settings are a backend's own settings: what its Entry.Flags parsed, plus what tests put
// there (fakes of the node's tools), which no flag sets.
type Settings interface {
	// Check validates the settings: every flag within its bounds. Its error is a mistake on
	// the command line.
	Check() error
}

// Env is what an entry's functions are given: the settings every backend shares, and its own.
type Env struct {
	// Interfaces are the uplinks (--interfaces); empty means the devices pod traffic leaves by.
	Interfaces []string
	// Logger receives the backend's logs; never nil.
	Logger *slog.Logger
	// Own are the backend's own settings, of the type its Entry.Flags returns.
	Own Settings
}
