// Package cli implements the ip-masq-agent command line: the agent itself and its subcommands.
// Flags keep the upstream ip-masq-agent names and defaults; "--flag=value" and "--flag value"
// both work, and flags may come before or after positional arguments.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/backends"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/version"
)

// usageError marks a mistake on the command line (exit code 2, as the flag package uses).
type usageError struct{ error }

func (e usageError) Unwrap() error { return e.error }

// ExitCode maps an error returned by Run to a process exit code.
func ExitCode(err error) int {
	var ue usageError
	if errors.As(err, &ue) || errors.Is(err, flag.ErrHelp) {
		return 2
	}
	return 1
}

type command struct {
	name string
	// args are the command's arguments in its usage line, summary what it does.
	args, summary string
	// example is one way to run it: its arguments after the program's name.
	example string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

// agentCommand is the agent itself, what runs without a command name.
var agentCommand = command{args: "[flags]", summary: "run the agent",
	example: "--config=/etc/config/ip-masq-agent --backend=auto --enable-ipv6 --metrics-address=:9743"}

func commands() []command {
	return []command{
		{"explain", "[flags] ADDR...", "which rule decides each address, and why",
			"explain --config=/etc/config/ip-masq-agent 10.96.0.1 169.254.169.254 8.8.8.8", runExplain},
		{"render", "[flags]", "print what a backend would apply (--backend: " + backends.Renderable() + "); nothing is applied",
			"render --config=/etc/config/ip-masq-agent --backend=nftables --enable-ipv6", runRender},
		{"dump", "[flags]", "the installed rules with hit counters, and the NAT table",
			"dump --config=/etc/config/ip-masq-agent --top=5", runDump},
		{"cleanup", "[flags]", "remove everything the agent installed (" + backends.Installs() + ")",
			"cleanup --bpffs=/sys/fs/bpf --masq-chain=IP-MASQ-AGENT", runCleanup},
		{"rollout", "[flags]", "run the rollout controller: one per cluster, it rolls each new generation of an " + kube.Configs.Kind + " out in waves",
			"rollout --config-name=default --waves=1,10,50,100 --hold=2m", runRollout},
		{"holder", "[--mine]", "who holds the node lock; --mine fails unless this container's agent does (the DaemonSet's startup probe)",
			"holder --mine", runHolder},
		{"version", "", "print the version", "version", runVersion},
	}
}

// command returns the command named name.
func commandNamed(name string) command {
	for _, c := range commands() {
		if c.name == name {
			return c
		}
	}
	return agentCommand
}

// commandNames lists the subcommands: "explain, render, ...".
func commandNames() string {
	var names []string
	for _, c := range commands() {
		names = append(names, c.name)
	}
	return strings.Join(names, ", ")
}

// Run executes the command line args (without the program name). A command's help (--help, -h,
// or help COMMAND) goes to stdout, and is no error; a mistake on the command line writes the
// command's usage line to stderr and returns the error, for the caller to print once.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c, args, err := commandOf(args)
	if err == nil {
		err = c.run(ctx, args, stdout, stderr)
	}
	if h, ok := errors.AsType[helpText](err); ok {
		_, err = io.WriteString(stdout, string(h))
		return err
	}
	if _, ok := errors.AsType[usageError](err); ok {
		printShortUsage(stderr, c)
	}
	return err
}

// commandOf finds the command args run, and its arguments: help COMMAND is COMMAND --help.
func commandOf(args []string) (command, []string, error) {
	agent := agentCommand
	agent.run = runAgent // not in agentCommand: runAgent reads it
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		return agent, args, nil
	}
	name, rest := args[0], args[1:]
	if name == "help" {
		switch {
		case len(rest) == 0 || rest[0] == "-h" || rest[0] == "--help" || rest[0] == "-help":
			return command{name: "help", run: func(_ context.Context, _ []string, stdout, _ io.Writer) error {
				printUsage(stdout)
				return nil
			}}, nil, nil
		case len(rest) > 1:
			return command{name: "help", args: "[COMMAND]"}, nil, usageError{fmt.Errorf("help takes one command, got %q", rest)}
		case rest[0] == "agent":
			return agent, []string{"--help"}, nil
		}
		name, rest = rest[0], []string{"--help"}
	}
	for _, c := range commands() {
		if c.name == name {
			return c, rest, nil
		}
	}
	return command{name: "help", args: "[COMMAND]"}, nil, usageError{fmt.Errorf("unknown command %q (commands: %s)", name, commandNames())}
}

// printShortUsage writes c's usage line, and where to read more, after a mistake.
func printShortUsage(w io.Writer, c command) {
	if c.name == "help" {
		fmt.Fprintln(w, "usage: ip-masq-agent help [COMMAND]\nrun 'ip-masq-agent help' for the commands")
		return
	}
	name := strings.TrimSpace("ip-masq-agent " + c.name)
	fmt.Fprintf(w, "usage: %s %s\nrun '%s --help' for its flags, and an example\n", name, c.args, name)
}

// helpText is a command's help, asked for with --help or -h: what Run writes to stdout.
type helpText string

func (h helpText) Error() string { return "help requested" }

func printUsage(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 4, 3, ' ', 0)
	fmt.Fprintf(tw, "usage: ip-masq-agent %s\t%s\n", agentCommand.args, agentCommand.summary)
	for _, c := range commands() {
		fmt.Fprintf(tw, "       ip-masq-agent %s %s\t%s\n", c.name, c.args, c.summary)
	}
	tw.Flush()
	fmt.Fprintln(w, "\nrun 'ip-masq-agent COMMAND --help' (or 'ip-masq-agent help COMMAND') for the flags of a command, and an example")
}

// policyFlags are the flags that decide the policy; the agent and every subcommand take them.
type policyFlags struct {
	configPath              string
	configPattern           string
	enableIPv6              bool
	noMasqAllReservedRanges bool
	randomFully             bool
	toPorts                 string
}

func (f *policyFlags) register(fs *flagSet) {
	fs.group("configuration", func() {
		fs.StringVar(&f.configPath, "config", config.DefaultPath, "configuration file (YAML or JSON), or a directory whose --config-pattern files are merged; missing means the defaults")
		fs.StringVar(&f.configPattern, "config-pattern", config.DefaultPattern, "in a --config directory, the files read and merged (a glob on file names)")
		fs.BoolVar(&f.enableIPv6, "enable-ipv6", false, "also manage IPv6 traffic")
		fs.BoolVar(&f.noMasqAllReservedRanges, "nomasq-all-reserved-ranges", false, "add all RFC reserved IPv4 ranges to the default nonMasqueradeCIDRs")
		fs.BoolVar(&f.randomFully, "random-fully", true, "choose masquerade source ports fully at random")
		fs.StringVar(&f.toPorts, "to-ports", "", `masquerade to these source ports only, e.g. "1024-29999,32768-65535" (tcp, udp, sctp; the BPF datapath also uses them for ICMP ids)`)
	})
}

// options validates the flags that do not depend on the file.
func (f *policyFlags) options() (config.Options, policy.Options, error) {
	ports, err := policy.ParsePortRanges(f.toPorts)
	if err != nil {
		return config.Options{}, policy.Options{}, usageError{err}
	}
	if err := config.CheckPattern(f.configPattern); err != nil {
		return config.Options{}, policy.Options{}, usageError{err}
	}
	return config.Options{EnableIPv6: f.enableIPv6, NoMasqAllReservedRanges: f.noMasqAllReservedRanges, Pattern: f.configPattern},
		policy.Options{EnableIPv6: f.enableIPv6, RandomFully: f.randomFully, ToPorts: ports}, nil
}

// backendFlags are the backends' own flags, each backend's registered by its registry entry.
type backendFlags struct {
	own backends.Settings
}

func (f *backendFlags) register(fs *flagSet) { f.own = backends.RegisterFlags(fs.FlagSet, fs.group) }

// check validates the backends' flags.
func (f *backendFlags) check() error {
	if err := f.own.Check(); err != nil {
		return usageError{err}
	}
	return nil
}

// load reads the configuration (a file or a directory) and compiles the policy.
func (f *policyFlags) load() (*policy.Policy, error) {
	copts, popts, err := f.options()
	if err != nil {
		return nil, err
	}
	cfg, err := config.Load(f.configPath, copts)
	if err != nil {
		return nil, err
	}
	return policy.Compile(cfg, popts), nil
}

// parseInterspersed parses flags that may appear before, between or after positional arguments,
// and returns the positional arguments. "--" ends flag parsing.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, help(fs)
			}
			return nil, usageError{err}
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return positional, nil
		}
		// fs.Parse consumed a "--" if the argument before rest was one.
		if n := len(args) - len(rest); n > 0 && args[n-1] == "--" {
			return append(positional, rest...), nil
		}
		positional = append(positional, rest[0])
		args = rest[1:]
	}
}

// parseNoArgs parses the flags of a command that takes no positional arguments.
func parseNoArgs(fs *flag.FlagSet, args []string) error {
	pos, err := parseInterspersed(fs, args)
	if err == nil && len(pos) > 0 {
		err = usageError{fmt.Errorf("%s takes no arguments, got %q", fs.Name(), pos)}
	}
	return err
}

// flagSet is a command's flags, registered group by group, so that its help shows them by
// concern, with the command's example.
type flagSet struct {
	*flag.FlagSet
	groups []flagGroup
	// unlisted are flags accepted and not read (listOnly): the help names them, apart.
	unlisted []string
}

type flagGroup struct {
	title string
	names []string
}

// newFlagSet returns the flag set of c. It writes nothing itself: parsing returns the help
// (helpText) when asked for it, and mistakes as errors, which Run reports.
func newFlagSet(c command, _ io.Writer) *flagSet {
	name := strings.TrimSpace("ip-masq-agent " + c.name)
	fs := &flagSet{FlagSet: flag.NewFlagSet(name, flag.ContinueOnError)}
	fs.SetOutput(io.Discard)
	// The flag package calls Usage on every mistake as well: only help writes it somewhere.
	fs.Usage = func() {
		w := fs.Output()
		fmt.Fprintf(w, "usage: %s %s\n%s\n\nexample:\n  ip-masq-agent %s\n", name, c.args, c.summary, c.example)
		for _, g := range fs.groups {
			if len(g.names) > 0 {
				fmt.Fprintf(w, "\n%s flags:\n", g.title)
				fs.printDefaults(w, g.names)
			}
		}
		if len(fs.unlisted) > 0 {
			fmt.Fprintf(w, "\naccepted and not read, so that the agent's arguments can be reused: --%s\n", strings.Join(fs.unlisted, ", --"))
		}
	}
	return fs
}

// listOnly keeps the flags named in the help, and moves the others to the list of those
// accepted and not read.
func (fs *flagSet) listOnly(names []string) {
	for i, g := range fs.groups {
		fs.groups[i].names = slices.DeleteFunc(slices.Clone(g.names), func(n string) bool {
			if slices.Contains(names, n) {
				return false
			}
			fs.unlisted = append(fs.unlisted, n)
			return true
		})
	}
}

// policyFlagNames are the flags of policyFlags: they say what the configuration is, and how its
// policy is made.
func policyFlagNames() []string {
	fs := newFlagSet(command{}, io.Discard)
	new(policyFlags).register(fs)
	return flagNames(fs)
}

// datapathFlagNames are the flags that say where the installed datapath is: the backends' own,
// and --interfaces.
func datapathFlagNames() []string {
	fs := newFlagSet(command{}, io.Discard)
	new(backendFlags).register(fs)
	return append(flagNames(fs), "interfaces")
}

func flagNames(fs *flagSet) []string {
	var out []string
	fs.VisitAll(func(f *flag.Flag) { out = append(out, f.Name) })
	return out
}

// help is the help of the command whose flags fs are.
func help(fs *flag.FlagSet) helpText {
	var b strings.Builder
	out := fs.Output()
	fs.SetOutput(&b)
	fs.Usage()
	fs.SetOutput(out)
	return helpText(b.String())
}

// group registers flags (register), under title in the help: added to the group of that title
// when there is one already.
func (fs *flagSet) group(title string, register func()) {
	before := map[string]bool{}
	fs.VisitAll(func(f *flag.Flag) { before[f.Name] = true })
	register()
	i := slices.IndexFunc(fs.groups, func(g flagGroup) bool { return g.title == title })
	if i < 0 {
		fs.groups, i = append(fs.groups, flagGroup{title: title}), len(fs.groups)
	}
	fs.VisitAll(func(f *flag.Flag) {
		if !before[f.Name] {
			fs.groups[i].names = append(fs.groups[i].names, f.Name)
		}
	})
}

// printDefaults prints the named flags as flag.PrintDefaults does, with the defaults they were
// registered with.
func (fs *flagSet) printDefaults(w io.Writer, names []string) {
	part := flag.NewFlagSet("", flag.ContinueOnError)
	part.SetOutput(w)
	for _, name := range names {
		f := fs.Lookup(name)
		part.Var(f.Value, f.Name, f.Usage)
		part.Lookup(name).DefValue = f.DefValue
	}
	part.PrintDefaults()
}

func runVersion(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet(commandNamed("version"), stderr)
	if _, err := parseInterspersed(fs.FlagSet, args); err != nil {
		return err
	}
	fmt.Fprintln(stdout, version.String())
	return nil
}

func runRender(_ context.Context, args []string, stdout, stderr io.Writer) error {
	var pf policyFlags
	var bf backendFlags
	fs := newFlagSet(commandNamed("render"), stderr)
	var backend string
	fs.group("render", func() {
		fs.StringVar(&backend, "backend", backends.RenderDefault, "the backend whose transactions to print: "+backends.Renderable())
	})
	pf.register(fs)
	bf.register(fs)
	if err := parseNoArgs(fs.FlagSet, args); err != nil {
		return err
	}
	render, ok := backends.Renderer(backend)
	if !ok {
		return usageError{fmt.Errorf("render --backend %q: must be %s", backend, backends.Renderable())}
	}
	if err := bf.check(); err != nil {
		return err
	}
	p, err := pf.load()
	if err != nil {
		return err
	}
	_, err = io.WriteString(stdout, render(p, backends.Options{Settings: bf.own}))
	return err
}
