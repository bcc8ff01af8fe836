package docs

import (
	"fmt"
	"go/ast"
	"go/build"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/markdown"
)

const troubleshooting = "docs/troubleshooting.md"

// wildcard stands for the part of a log message that varies: a non-constant operand of a
// concatenation, a verb of a format, a <placeholder> of the page.
const wildcard = "\x00"

// logMessage is one message the agent logs at WARN or ERROR.
type logMessage struct {
	level   string // "WARN" or "ERROR"
	pattern string // the message, with wildcard for what varies
}

func (m logMessage) String() string {
	return m.level + " " + strings.ReplaceAll(m.pattern, wildcard, "<...>")
}

// Every message the agent's code logs at WARN or ERROR is in the troubleshooting page's Log
// messages tables, at its level, and the tables list no message the code does not log.
func TestTroubleshootingListsEveryLogMessage(t *testing.T) {
	inCode := agentLogMessages(t)
	if len(inCode) == 0 {
		t.Fatal("found no log message at WARN or ERROR in the agent's code")
	}
	section, ok := markdown.Section(read(t, troubleshooting), "## Log messages")
	if !ok {
		t.Fatalf("%s has no Log messages section", troubleshooting)
	}
	listed := map[logMessage]bool{}
	for _, cells := range markdown.Rows(section) {
		if len(cells) != 4 || cells[0] != "WARN" && cells[0] != "ERROR" {
			t.Errorf("%s, Log messages: row %q: want 4 cells: WARN or ERROR, the message, what it means, what to do", troubleshooting, cells)
			continue
		}
		spans := markdown.CodeSpans(cells[1])
		if len(spans) != 1 {
			t.Errorf("%s, Log messages: row %q: the message must be one code span", troubleshooting, cells[1])
			continue
		}
		m := logMessage{cells[0], placeholderRE.ReplaceAllString(spans[0], wildcard)}
		if listed[m] {
			t.Errorf("%s lists %s twice", troubleshooting, m)
		}
		listed[m] = true
	}
	for m, where := range inCode {
		if !listed[m] {
			t.Errorf("%s logs %s, which %s does not list: add a row saying what it means and what to do", where, m, troubleshooting)
		}
	}
	for m := range listed {
		if _, ok := inCode[m]; !ok {
			t.Errorf("%s lists %s, which the agent never logs", troubleshooting, m)
		}
	}
}

var placeholderRE = regexp.MustCompile(`<[^<>]+>`)

// agentLogMessages finds every call that logs at WARN or ERROR in the packages the agent's
// binary is built from, with where each is.
//
// A call is a method Warn, Error, WarnContext or ErrorContext, or Log and LogAttrs with the
// level slog.LevelWarn or slog.LevelError written out (a level computed at run time is not
// seen here: write it out to log at WARN or ERROR). Its message must be a constant, a
// concatenation or an fmt.Sprintf format, so that it can be read.
func agentLogMessages(t *testing.T) map[logMessage]string {
	t.Helper()
	root := repoRoot(t)
	module := modulePath(t, root)
	found := map[logMessage]string{}
	seen := map[string]bool{}
	queue := []string{module + "/cmd/ip-masq-agent"}
	for len(queue) > 0 {
		path := queue[0]
		queue = queue[1:]
		if seen[path] {
			continue
		}
		seen[path] = true
		dir := filepath.Join(root, strings.TrimPrefix(path, module))
		pkg, err := build.Default.ImportDir(dir, 0)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		for _, imp := range pkg.Imports {
			if imp == module || strings.HasPrefix(imp, module+"/") {
				queue = append(queue, imp)
			}
		}
		fset := token.NewFileSet()
		var files []*ast.File
		for _, name := range pkg.GoFiles {
			f, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, 0)
			if err != nil {
				t.Fatal(err)
			}
			files = append(files, f)
		}
		consts := stringConsts(files)
		for _, f := range files {
			ast.Inspect(f, func(n ast.Node) bool {
				call, ok := n.(*ast.CallExpr)
				if !ok {
					return true
				}
				level, msg, ok := logCall(call)
				if !ok {
					return true
				}
				where := fset.Position(call.Pos())
				rel, _ := filepath.Rel(root, where.Filename)
				loc := fmt.Sprintf("%s:%d", rel, where.Line)
				pattern, ok := eval(msg, consts)
				if !ok || pattern == wildcard {
					t.Errorf("%s: cannot read the message of a log call at %s: write it as a constant", loc, level)
					return true
				}
				found[logMessage{level, pattern}] = loc
				return true
			})
		}
	}
	return found
}

func modulePath(t *testing.T, root string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if m, ok := strings.CutPrefix(l, "module "); ok {
			return strings.TrimSpace(m)
		}
	}
	t.Fatal("go.mod names no module")
	return ""
}

// logCall tells whether call logs at WARN or ERROR, and returns the level and the message.
func logCall(call *ast.CallExpr) (level string, msg ast.Expr, ok bool) {
	sel, ok := call.Fun.(*ast.SelectorExpr)
	if !ok {
		return "", nil, false
	}
	arg := func(i int) ast.Expr {
		if i < len(call.Args) {
			return call.Args[i]
		}
		return nil
	}
	switch sel.Sel.Name {
	case "Warn":
		level, msg = "WARN", arg(0)
	case "Error":
		level, msg = "ERROR", arg(0)
	case "WarnContext":
		level, msg = "WARN", arg(1)
	case "ErrorContext":
		level, msg = "ERROR", arg(1)
	case "Log", "LogAttrs":
		lv, ok := arg(1).(*ast.SelectorExpr)
		if !ok || !isIdent(lv.X, "slog") || lv.Sel.Name != "LevelWarn" && lv.Sel.Name != "LevelError" {
			return "", nil, false
		}
		level, msg = strings.ToUpper(strings.TrimPrefix(lv.Sel.Name, "Level")), arg(2)
	default:
		return "", nil, false
	}
	return level, msg, msg != nil
}

func isIdent(e ast.Expr, name string) bool {
	id, ok := e.(*ast.Ident)
	return ok && id.Name == name
}

// stringConsts collects the package's string constants, by name.
func stringConsts(files []*ast.File) map[string]string {
	consts := map[string]string{}
	for range 4 { // constants defined from constants: a few rounds resolve them
		for _, f := range files {
			for _, d := range f.Decls {
				gd, ok := d.(*ast.GenDecl)
				if !ok || gd.Tok != token.CONST {
					continue
				}
				for _, s := range gd.Specs {
					vs := s.(*ast.ValueSpec)
					for i, name := range vs.Names {
						if i >= len(vs.Values) {
							continue
						}
						if v, ok := eval(vs.Values[i], consts); ok && !strings.Contains(v, wildcard) {
							consts[name.Name] = v
						}
					}
				}
			}
		}
	}
	return consts
}

var verbRE = regexp.MustCompile(`%[-+# 0]*[0-9*]*(\.[0-9*]*)?[a-zA-Z]`)

// eval reads a message expression into a pattern: constants as they are, anything else as
// wildcard; false when e is no string expression at all.
func eval(e ast.Expr, consts map[string]string) (string, bool) {
	switch e := e.(type) {
	case *ast.BasicLit:
		if e.Kind != token.STRING {
			return "", false
		}
		s, err := strconv.Unquote(e.Value)
		return s, err == nil
	case *ast.Ident:
		if v, ok := consts[e.Name]; ok {
			return v, true
		}
		return wildcard, true
	case *ast.ParenExpr:
		return eval(e.X, consts)
	case *ast.BinaryExpr:
		if e.Op != token.ADD {
			return "", false
		}
		a, ok1 := eval(e.X, consts)
		b, ok2 := eval(e.Y, consts)
		return squeeze(a + b), ok1 && ok2
	case *ast.CallExpr:
		if sel, ok := e.Fun.(*ast.SelectorExpr); ok && isIdent(sel.X, "fmt") && sel.Sel.Name == "Sprintf" && len(e.Args) > 0 {
			format, ok := eval(e.Args[0], consts)
			if !ok {
				return "", false
			}
			parts := strings.Split(format, "%%")
			for i := range parts {
				parts[i] = verbRE.ReplaceAllString(parts[i], wildcard)
			}
			return squeeze(strings.Join(parts, "%")), true
		}
		return wildcard, true
	case *ast.SelectorExpr:
		return wildcard, true
	}
	return "", false
}

// squeeze makes runs of wildcards one.
func squeeze(s string) string {
	for strings.Contains(s, wildcard+wildcard) {
		s = strings.ReplaceAll(s, wildcard+wildcard, wildcard)
	}
	return s
}

// The reader of the message patterns sees what it should: constants, concatenations with
// variables, formats.
func TestLogMessagePatterns(t *testing.T) {
	src := `package p
const prefix = "the "
const whole = prefix + "thing"
func f() {
	log.Warn("plain", "k", v)
	b.log.Error(whole)
	log.Warn("cannot subscribe to netlink "+what+" events; retrying")
	log.Warn(fmt.Sprintf("the %s datapath cannot run here; using %s (100%%)", a, b))
	log.Log(ctx, slog.LevelError, "at error")
	log.Log(ctx, level, "computed: not seen")
	log.Info("info: not seen")
	log.ErrorContext(ctx, "with a context")
}`
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "p.go", src, 0)
	if err != nil {
		t.Fatal(err)
	}
	consts := stringConsts([]*ast.File{f})
	var got []string
	ast.Inspect(f, func(n ast.Node) bool {
		if call, ok := n.(*ast.CallExpr); ok {
			if level, msg, ok := logCall(call); ok {
				p, _ := eval(msg, consts)
				got = append(got, logMessage{level, p}.String())
			}
		}
		return true
	})
	want := []string{
		"WARN plain", "ERROR the thing", "WARN cannot subscribe to netlink <...> events; retrying",
		"WARN the <...> datapath cannot run here; using <...> (100%)", "ERROR at error", "ERROR with a context",
	}
	if !slices.Equal(got, want) {
		t.Errorf("read\n%q\nwant\n%q", got, want)
	}
}
