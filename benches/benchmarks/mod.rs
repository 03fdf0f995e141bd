pub mod cast;
