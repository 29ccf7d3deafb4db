//! Shell completions that know casadm's forms, made by walking the clap definition.
//!
//! clap_complete cannot offer them: the verbs are subcommands whose short and long flags (`-S`,
//! `--start-cache`) it does not follow, and it offers nothing for values a function parses (the
//! cache modes). So the tree is read here once into [`Node`]s (every visible command, the words
//! that enter it, its options and what each option's value is), and each shell's script is
//! printed from that tree: a verb or option added to cli.rs shows up by itself.
//!
//! What a value completes to is taken from the definition in this order: the possible values
//! clap knows (`value_enum`, `PossibleValuesParser`: output formats, parameter groups); cache and
//! core ids for `--cache-id`/`--core-id` (asked of the running daemon with `-L -o csv`); file
//! and directory names for path values (`PathBuf`, or a device: a value named `DEV`/`DEVICE`);
//! the alternatives a value name lists (`wt|wb|wa|wi|wo|pt`, `yes|no`); else nothing, so free
//! text (a size, a threshold) is not offered file names. Hidden commands and options are left
//! out, as in `-H`.

use std::fmt::Write as _;

/// What an option's value (or a positional) completes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Values {
    Words(Vec<String>),
    /// Words given comma-separated in one value (`-P -f conf,usage`).
    List(Vec<String>),
    Files,
    Dirs,
    CacheIds,
    CoreIds,
    /// Free text: nothing is offered.
    Any,
}

/// An option of a command.
#[derive(Debug, Clone)]
pub struct Opt {
    /// Every spelling: `-d`, `--cache-device`, visible aliases.
    pub forms: Vec<String>,
    pub help: String,
    /// None: a flag, which takes no value.
    pub values: Option<Values>,
    /// May be given more than once (`-v -v`, an appended list): offered again once typed.
    pub repeats: bool,
}

/// A command as the shells see it: `key` is its path below `hybridcache` ("" for the program,
/// "start-cache", "bench run").
#[derive(Debug, Clone)]
pub struct Node {
    pub key: String,
    /// The subcommands: their name, every word that enters them (name, `--long`, `-S`), their
    /// key and their one-line help.
    pub subs: Vec<Sub>,
    pub opts: Vec<Opt>,
    /// What the first positional argument takes, if any.
    pub positional: Option<Values>,
}

#[derive(Debug, Clone)]
pub struct Sub {
    pub name: String,
    pub forms: Vec<String>,
    pub key: String,
    pub help: String,
}

/// Every visible command of `cmd` (built, so the global options are in each), parents first.
pub fn tree(cmd: &clap::Command) -> Vec<Node> {
    let mut nodes = Vec::new();
    walk(cmd, String::new(), &mut nodes);
    nodes
}

fn walk(cmd: &clap::Command, key: String, nodes: &mut Vec<Node>) {
    let visible: Vec<&clap::Command> = cmd.get_subcommands().filter(|s| !s.is_hide_set()).collect();
    let child_key = |s: &clap::Command| {
        if key.is_empty() {
            s.get_name().to_string()
        } else {
            format!("{key} {}", s.get_name())
        }
    };
    let subs = visible
        .iter()
        .map(|s| Sub {
            name: s.get_name().to_string(),
            forms: verb_forms(s),
            key: child_key(s),
            help: first_line(s.get_about().map(|a| a.to_string())),
        })
        .collect();
    let args: Vec<&clap::Arg> = cmd.get_arguments().filter(|a| !a.is_hide_set()).collect();
    let opts = args
        .iter()
        .filter(|a| !a.is_positional())
        .map(|a| Opt {
            forms: option_forms(a),
            help: first_line(a.get_help().map(|h| h.to_string())),
            values: a.get_action().takes_values().then(|| values(a)),
            repeats: matches!(
                a.get_action(),
                clap::ArgAction::Append | clap::ArgAction::Count
            ),
        })
        .collect();
    let positional = args.iter().find(|a| a.is_positional()).map(|a| values(a));
    nodes.push(Node {
        key: key.clone(),
        subs,
        opts,
        positional,
    });
    for s in visible {
        walk(s, child_key(s), nodes);
    }
}

/// The words a verb is typed as: `start-cache`, `--start-cache`, `-S`, and visible aliases.
pub fn verb_forms(s: &clap::Command) -> Vec<String> {
    let mut forms = vec![s.get_name().to_string()];
    forms.extend(s.get_visible_aliases().map(String::from));
    if let Some(l) = s.get_long_flag() {
        forms.push(format!("--{l}"));
    }
    forms.extend(s.get_visible_long_flag_aliases().map(|l| format!("--{l}")));
    if let Some(c) = s.get_short_flag() {
        forms.push(format!("-{c}"));
    }
    forms.extend(s.get_visible_short_flag_aliases().map(|c| format!("-{c}")));
    forms
}

fn option_forms(a: &clap::Arg) -> Vec<String> {
    let mut forms = Vec::new();
    if let Some(c) = a.get_short() {
        forms.push(format!("-{c}"));
    }
    forms.extend(
        a.get_visible_short_aliases()
            .unwrap_or_default()
            .into_iter()
            .map(|c| format!("-{c}")),
    );
    if let Some(l) = a.get_long() {
        forms.push(format!("--{l}"));
    }
    forms.extend(
        a.get_visible_aliases()
            .unwrap_or_default()
            .into_iter()
            .map(|l| format!("--{l}")),
    );
    forms
}

/// What a value of `a` completes to (the module comment gives the order).
fn values(a: &clap::Arg) -> Values {
    use clap::ValueHint;
    let possible: Vec<String> = a
        .get_possible_values()
        .into_iter()
        .filter(|p| !p.is_hide_set())
        .map(|p| p.get_name().to_string())
        .collect();
    if !possible.is_empty() {
        return match a.get_value_delimiter() {
            Some(',') => Values::List(possible),
            _ => Values::Words(possible),
        };
    }
    match a.get_long() {
        Some("cache-id") => return Values::CacheIds,
        Some("core-id") => return Values::CoreIds,
        _ => {}
    }
    let name = a
        .get_value_names()
        .and_then(|n| n.first())
        .map(|n| n.to_string())
        .unwrap_or_default();
    match a.get_value_hint() {
        ValueHint::DirPath => return Values::Dirs,
        ValueHint::AnyPath | ValueHint::FilePath | ValueHint::ExecutablePath => {
            return Values::Files
        }
        _ => {}
    }
    if name == "DEV" || name == "DEVICE" || a.get_long().is_some_and(|l| l.ends_with("device")) {
        return Values::Files;
    }
    if name.contains('|') {
        return Values::Words(name.split('|').map(String::from).collect());
    }
    Values::Any
}

fn first_line(s: Option<String>) -> String {
    s.unwrap_or_default()
        .lines()
        .next()
        .unwrap_or_default()
        .trim_end_matches('.')
        .to_string()
}

/// A word for a shell's single quotes.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// `case` patterns matching `key|word` for each word.
fn patterns(key: &str, words: &[String]) -> String {
    words
        .iter()
        .map(|w| quote(&format!("{key}|{w}")))
        .collect::<Vec<_>>()
        .join("|")
}

/// How the shell scripts name a kind of value.
fn kind(v: &Values) -> String {
    match v {
        Values::Words(w) => format!("words {}", w.join(" ")),
        Values::List(w) => format!("list {}", w.join(" ")),
        Values::Files => "files".into(),
        Values::Dirs => "dirs".into(),
        Values::CacheIds => "cache-ids".into(),
        Values::CoreIds => "core-ids".into(),
        Values::Any => "any".into(),
    }
}

/// The bash script; `func` is the completion function's name (zsh runs the same script under
/// another name).
pub fn bash(nodes: &[Node], func: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# hybridcache(8) bash completion, generated by `hybridcache gen completions` from the\n\
         # CLI's definition: verbs in every form (start-cache, --start-cache, -S), their options,\n\
         # the values those take, cache and core ids from the running daemon.\n"
    );
    // key|word -> the subcommand's key.
    let _ = writeln!(s, "{func}_sub() {{\n    case \"$1|$2\" in");
    for n in nodes {
        for sub in &n.subs {
            let _ = writeln!(
                s,
                "        {}) echo {} ;;",
                patterns(&n.key, &sub.forms),
                quote(&sub.key)
            );
        }
    }
    let _ = writeln!(s, "        *) return 1 ;;\n    esac\n}}\n");
    // key|option -> what its value takes; fails for a flag or an unknown word.
    let _ = writeln!(s, "{func}_value() {{\n    case \"$1|$2\" in");
    for n in nodes {
        for o in &n.opts {
            if let Some(v) = &o.values {
                let _ = writeln!(
                    s,
                    "        {}) echo {} ;;",
                    patterns(&n.key, &o.forms),
                    quote(&kind(v))
                );
            }
        }
    }
    let _ = writeln!(s, "        *) return 1 ;;\n    esac\n}}\n");
    // key|option -> every form of that option, once typed not to be offered again; fails for
    // one that may be repeated.
    let _ = writeln!(s, "{func}_same() {{\n    case \"$1|$2\" in");
    for n in nodes {
        for o in n.opts.iter().filter(|o| !o.repeats) {
            let _ = writeln!(
                s,
                "        {}) echo {} ;;",
                patterns(&n.key, &o.forms),
                quote(&o.forms.join(" "))
            );
        }
    }
    let _ = writeln!(s, "        *) return 1 ;;\n    esac\n}}\n");
    // key -> the words offered for a word starting with `-`, for one that does not, and what a
    // positional takes.
    let _ = writeln!(s, "{func}_words() {{\n    case \"$1|$2\" in");
    for n in nodes {
        let mut dashed: Vec<String> = n
            .subs
            .iter()
            .flat_map(|sub| sub.forms.iter().filter(|f| f.starts_with('-')).cloned())
            .collect();
        dashed.extend(n.opts.iter().flat_map(|o| o.forms.iter().cloned()));
        let names: Vec<String> = n.subs.iter().map(|sub| sub.name.clone()).collect();
        let _ = writeln!(
            s,
            "        {}) echo {} ;;",
            quote(&format!("{}|-", n.key)),
            quote(&dashed.join(" "))
        );
        if !names.is_empty() {
            let _ = writeln!(
                s,
                "        {}) echo {} ;;",
                quote(&format!("{}|", n.key)),
                quote(&format!("words {}", names.join(" ")))
            );
        } else if let Some(p) = &n.positional {
            let _ = writeln!(
                s,
                "        {}) echo {} ;;",
                quote(&format!("{}|", n.key)),
                quote(&kind(p))
            );
        }
    }
    let _ = writeln!(s, "        *) return 1 ;;\n    esac\n}}\n");
    s += &BASH_BODY.replace("_FUNC", func);
    let _ = writeln!(s, "complete -F {func} hybridcache");
    s
}

/// The walk over the typed words and the offers, the same for every command tree. `_FUNC` is
/// the function's name. Written for bash and for zsh's bashcompinit (no mapfile, no `((i++))`
/// whose status is that of its old value; zsh's COMP_WORDS is 0-based there too).
const BASH_BODY: &str = r#"# The cache ids of the running daemon, or the core ids of cache $2; nothing when the daemon is
# down or slow (2 s), and never an error on the terminal.
_FUNC_ids() {
    local run=("${COMP_WORDS[0]}" -L -o csv)
    [[ -n $1 ]] && run+=(--control "$1")
    if command -v timeout >/dev/null 2>&1; then run=(timeout 2 "${run[@]}"); fi
    "${run[@]}" 2>/dev/null </dev/null | awk -F, -v want="$2" '
        $1 == "cache" { cache = $2; if (want == "") print $2; next }
        $1 == "core" && want != "" && cache == want { print $2 }'
}

_FUNC() {
    local hc_words=() cword=0 glue="" key="" word pending="" control="" cache="" sub kind i=0
    # The forms of the options typed for the current command, space-delimited.
    local typed=" "
    local IFS=$' \t\n'
    COMPREPLY=()
    # bash breaks words at `:` too (COMP_WORDBREAKS): `file:/dev/x` arrives as `file`, `:`,
    # `/dev/x`. Put such words back together; the offers are then trimmed to the part after
    # the last `:`, which is all bash replaces.
    while [[ $i -le $COMP_CWORD ]]; do
        word=${COMP_WORDS[i]}
        if [[ $word == ":" && $cword -gt 0 ]]; then
            hc_words[cword-1]+=":"
            glue=1
        elif [[ -n $glue ]]; then
            hc_words[cword-1]+=$word
            glue=""
        else
            hc_words[cword]=$word
            cword=$((cword + 1))
        fi
        i=$((i + 1))
    done
    cword=$((cword - 1))
    local cur=${hc_words[cword]} colon="" keep=""
    # Up to the word's last `:`; bash replaces only what follows it when it split the word
    # (zsh's bashcompinit does not split: there the whole word is replaced, `keep` kept).
    [[ $cur == *:* ]] && colon=${cur%"${cur##*:}"}
    [[ $cur == "${COMP_WORDS[COMP_CWORD]}" ]] && keep=$colon
    i=1
    # `--opt=value`: bash splits it at `=` into three words.
    if [[ $cur == "=" ]]; then cur=""; fi
    while [[ $i -lt $cword ]]; do
        word=${hc_words[i]}
        if [[ $word == "=" ]]; then
            :
        elif [[ -z $pending && $word == --*=* ]]; then
            # `--opt=value` in one word (where `=` does not break words).
            case ${word%%=*} in
                --control) control=${word#*=} ;;
                --cache-id) cache=${word#*=} ;;
            esac
            typed+="$(_FUNC_same "$key" "${word%%=*}") "
        elif [[ -n $pending ]]; then
            case $pending in
                --control) control=$word ;;
                -i|--cache-id) cache=$word ;;
            esac
            pending=""
        elif [[ $word == -* ]] && _FUNC_value "$key" "$word" >/dev/null; then
            pending=$word
            typed+="$(_FUNC_same "$key" "$word") "
        elif sub=$(_FUNC_sub "$key" "$word"); then
            key=$sub
            typed=" "
        elif [[ $word == -[!-]?* && $word != *=* ]]; then
            # Clustered short options (`-fl`, `-fc wb`, `-i3`): letter by letter; the first
            # that takes a value takes the rest of the word, or else the next word.
            local rest=${word#-} letter
            while [[ -n $rest ]]; do
                letter=-${rest:0:1}
                rest=${rest:1}
                typed+="$(_FUNC_same "$key" "$letter") "
                if _FUNC_value "$key" "$letter" >/dev/null; then
                    if [[ -z $rest ]]; then
                        pending=$letter
                    elif [[ $letter == -i ]]; then
                        cache=$rest
                    fi
                    break
                fi
            done
        elif [[ $word == -* ]]; then
            typed+="$(_FUNC_same "$key" "$word") "
        fi
        i=$((i + 1))
    done
    if [[ -n $pending ]]; then
        kind=$(_FUNC_value "$key" "$pending")
    elif [[ $cur == -* ]]; then
        kind="words"
        for word in $(_FUNC_words "$key" -); do
            [[ $typed == *" $word "* ]] || kind+=" $word"
        done
    else
        kind=$(_FUNC_words "$key" "") || return 0
    fi
    case $kind in
        words\ *)
            COMPREPLY=($(compgen -W "${kind#words }" -- "$cur")) ;;
        list\ *)
            # The next word of a comma-separated list, after those typed.
            if [[ $cur == *,* ]]; then
                COMPREPLY=($(compgen -P "${cur%,*}," -W "${kind#list }" -- "${cur##*,}"))
            else
                COMPREPLY=($(compgen -W "${kind#list }" -- "$cur"))
            fi ;;
        files)
            if type compopt >/dev/null 2>&1; then compopt -o filenames 2>/dev/null; fi
            local IFS=$'\n'
            COMPREPLY=($(compgen -P "$keep" -f -- "${cur#"$colon"}")) ;;
        dirs)
            if type compopt >/dev/null 2>&1; then compopt -o filenames 2>/dev/null; fi
            local IFS=$'\n'
            COMPREPLY=($(compgen -P "$keep" -d -- "${cur#"$colon"}")) ;;
        cache-ids)
            COMPREPLY=($(compgen -W "$(_FUNC_ids "$control" "")" -- "$cur")) ;;
        core-ids)
            if [[ -n $cache ]]; then
                COMPREPLY=($(compgen -W "$(_FUNC_ids "$control" "$cache")" -- "$cur"))
            fi ;;
    esac
    if [[ -n $colon && -z $keep && $kind != files && $kind != dirs ]]; then
        i=0
        while [[ $i -lt ${#COMPREPLY[@]} ]]; do
            COMPREPLY[i]=${COMPREPLY[i]#"$colon"}
            i=$((i + 1))
        done
    fi
    return 0
}

"#;

/// The zsh script: zsh's bashcompinit runs the bash function (the same walk and the same
/// tree), under a name of its own since this file's body is the function `_hybridcache`.
pub fn zsh(nodes: &[Node]) -> String {
    let script = bash(nodes, "_hybridcache_bash");
    format!(
        "#compdef hybridcache\n\
         # zsh completion for hybridcache(8): the bash completion run by bashcompinit.\n\
         autoload -U +X bashcompinit && bashcompinit\n\
         {script}\
         # The first completion loads this file; later ones call the registered function.\n\
         # (Sourced outside a completion, as by a test, it only defines the functions.)\n\
         if (( ${{+compstate}} )); then _bash_complete -F _hybridcache_bash \"$@\"; fi\n"
    )
}

/// The fish script: a function finds the command being typed (the same walk as bash's), and
/// one `complete` line per verb form, option and value set.
pub fn fish(nodes: &[Node]) -> String {
    let mut s = String::from(
        "# hybridcache(8) fish completion, generated by `hybridcache gen completions` from the\n\
         # CLI's definition.\n\n",
    );
    s += "function __hybridcache_sub\n    switch \"$argv[1]|$argv[2]\"\n";
    for n in nodes {
        for sub in &n.subs {
            let pats: Vec<String> = sub
                .forms
                .iter()
                .map(|f| quote(&format!("{}|{f}", n.key)))
                .collect();
            let _ = writeln!(
                s,
                "        case {}\n            echo {}",
                pats.join(" "),
                quote(&sub.key)
            );
        }
    }
    s += "        case '*'\n            return 1\n    end\nend\n\n";
    s += "function __hybridcache_takes_value\n    switch \"$argv[1]|$argv[2]\"\n";
    let mut any = Vec::new();
    for n in nodes {
        for o in n.opts.iter().filter(|o| o.values.is_some()) {
            any.extend(o.forms.iter().map(|f| quote(&format!("{}|{f}", n.key))));
        }
    }
    if !any.is_empty() {
        let _ = writeln!(s, "        case {}\n            return 0", any.join(" "));
    }
    s += "    end\n    return 1\nend\n\n";
    s += FISH_BODY;
    for n in nodes {
        // Keys are words of the definition ("bench run"): no quote of either kind.
        let cond = format!("-n '__hybridcache_at \"{}\"'", n.key);
        for sub in &n.subs {
            let _ = writeln!(
                s,
                "complete -c hybridcache {cond} -f -a {} -d {}",
                quote(&sub.name),
                quote(&sub.help)
            );
            for f in sub.forms.iter().filter(|f| f.starts_with('-')) {
                let _ = writeln!(
                    s,
                    "complete -c hybridcache {cond} -f {} -d {}",
                    fish_option(f),
                    quote(&sub.help)
                );
            }
        }
        for o in &n.opts {
            let spell: Vec<String> = o.forms.iter().map(|f| fish_option(f)).collect();
            let value = match &o.values {
                None => "-f".to_string(),
                Some(v) => fish_values(v),
            };
            let _ = writeln!(
                s,
                "complete -c hybridcache {cond} {} {value} -d {}",
                spell.join(" "),
                quote(&o.help)
            );
        }
        if n.subs.is_empty() {
            if let Some(p) = &n.positional {
                let _ = writeln!(s, "complete -c hybridcache {cond} {}", fish_values(p));
            }
        }
    }
    s
}

fn fish_option(f: &str) -> String {
    match f.strip_prefix("--") {
        Some(l) => format!("-l {l}"),
        None => format!("-s {}", f.trim_start_matches('-')),
    }
}

fn fish_values(v: &Values) -> String {
    match v {
        Values::Words(w) | Values::List(w) => format!("-x -a {}", quote(&w.join(" "))),
        Values::Files => "-r -F".into(),
        Values::Dirs => "-x -a '(__fish_complete_directories)'".into(),
        Values::CacheIds => "-x -a '(__hybridcache_ids)'".into(),
        Values::CoreIds => "-x -a '(__hybridcache_ids core)'".into(),
        Values::Any => "-x".into(),
    }
}

/// Fish's walk: the command being typed (`__hybridcache_key`), and the daemon's ids.
const FISH_BODY: &str = r#"# The key of the command being typed; also sets __hybridcache_control and __hybridcache_cache.
function __hybridcache_key
    set -l tokens (commandline -opc)
    set -l key ''
    set -l pending ''
    set -g __hybridcache_control ''
    set -g __hybridcache_cache ''
    for word in $tokens[2..-1]
        if test -n "$pending"
            switch $pending
                case --control
                    set -g __hybridcache_control $word
                case -i --cache-id
                    set -g __hybridcache_cache $word
            end
            set pending ''
        else if string match -q -- '-*' $word; and __hybridcache_takes_value $key $word
            set pending $word
        else if set -l sub (__hybridcache_sub $key $word)
            set key $sub
        end
    end
    echo $key
end

function __hybridcache_at
    test (__hybridcache_key) = "$argv[1]"
end

# Cache ids of the running daemon (or, with `core`, the core ids of the cache given by -i);
# nothing when the daemon is down.
function __hybridcache_ids
    __hybridcache_key >/dev/null
    set -l run (commandline -opc)[1] -L -o csv
    if test -n "$__hybridcache_control"
        set run $run --control $__hybridcache_control
    end
    set -l want ''
    if test "$argv[1]" = core
        test -n "$__hybridcache_cache"; or return
        set want $__hybridcache_cache
    end
    timeout 2 $run 2>/dev/null </dev/null | awk -F, -v want="$want" '
        $1 == "cache" { cache = $2; if (want == "") print $2; next }
        $1 == "core" && want != "" && cache == want { print $2 }'
end

complete -c hybridcache -f
"#;
